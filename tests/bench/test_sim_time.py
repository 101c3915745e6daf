"""Honest timing in the bench: the simulated clock's draft-time model (`--draft-time-ms`), the draft's call and
row counters it reads, results.json's record of the model, and the machine-bound flag of real runs."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from coordinator.bench.run import BenchConfig, Variant, summarize, table
from coordinator.core.drafts.base import DraftNode
from coordinator.core.drafts.job import DraftResults
from coordinator.core.schedulers.base import Emit, Finish, Inject, Request
from coordinator.core.stats import RequestStats
from coordinator.bench.common import poisson_arrivals
from coordinator.engine.loops.simulated import SimulatedPipeline
from services.config import describe_draft_time, parse_draft_time


# -- the flag ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, stage, want", [
    ("", (120.0, 0.25), (36.0, 0.075)),          # default: 0.3 x the stage-time model
    (None, (10.0, 0.0), (3.0, 0.0)),
    ("5", (120.0, 0.0), (5.0, 0.0)),
    (" 2.5 + 0.5 ", (120.0, 0.0), (2.5, 0.5)),
    ("0", (120.0, 0.0), (0.0, 0.0)),
    ("measured", (120.0, 0.0), ("measured", 1.0)),
    ("Measured", (1.0, 0.0), ("measured", 1.0)),
])
def test_parse_draft_time(spec, stage, want):
    assert parse_draft_time(spec, stage) == want


@pytest.mark.parametrize("bad", ["abc", "-1", "1+", "+1", "1+2+3", "measured+1", "1e3", "5ms", "1,2"])
def test_parse_draft_time_rejects(bad):
    with pytest.raises(ValueError, match="draft time .* A or A\\+B .*measured"):
        parse_draft_time(bad, (120.0, 0.0))


def test_describe_draft_time():
    assert describe_draft_time("", (36.0, 0.075)) == \
        "modelled 36 ms per draft call + 0.075 ms per row (0.3 x stage time)"
    assert describe_draft_time("5+1", (5.0, 1.0)) == "modelled 5 ms per draft call + 1 ms per row (--draft-time-ms 5+1)"
    assert describe_draft_time("measured", ("measured", 1.0)) == "measured CPU"


def test_bench_config_validates_the_draft_time():
    with pytest.raises(ValueError, match="draft time 'fast'"):
        BenchConfig(stages=[2], methods=["pp"], widths=[4], policies=["hybrid"], draft_time_ms="fast")
    assert BenchConfig(stages=[2], methods=["pp"], widths=[4], policies=["hybrid"],
                       draft_time_ms="3+1").draft_time_ms == "3+1"


async def test_cli_draft_time_needs_simulate():
    """Refused before any model is resolved (cmd_bench directly: cli.main would point the logs at capsys)."""
    from coordinator.cli.main import build_parser, cmd_bench
    with pytest.raises(ValueError, match="--draft-time-ms .*add --simulate"):
        await cmd_bench(build_parser().parse_args(["bench", "--draft-time-ms", "5"]))
    with pytest.raises(ValueError, match="draft time '5\\+x' is not of the form"):
        await cmd_bench(build_parser().parse_args(["bench", "--simulate", "--draft-time-ms", "5+x"]))
    args = build_parser().parse_args(["bench", "--simulate", "--draft-time-ms", "measured"])
    assert args.draft_time_ms == "measured" and build_parser().parse_args(["bench"]).draft_time_ms is None


# -- the simulated clock charges the model exactly ---------------------------------------------------------------
class FakeDraft:
    """Counters advanced by hand; `calls`/`rows` are all the pipeline may read (plus compute_s when measured)."""

    def __init__(self) -> None:
        self.compute_s, self.calls, self.rows = 0.0, 0, 0


class OneWorkScheduler:
    """Duck-typed scheduler: on add, one round of deferred work makes `calls` draft calls over `rows` rows (and
    takes `cpu_s` of measured time), then emits one token and finishes. No micro-batch ever leaves."""

    def __init__(self, draft: FakeDraft, calls: int, rows: int, cpu_s: float) -> None:
        self.draft, self.calls, self.rows, self.cpu_s = draft, calls, rows, cpu_s
        self.actions, self.pending = [], []

    def add(self, r: Request) -> None:
        self.pending.append(r.request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.pending)

    def work(self) -> None:
        rid = self.pending.pop(0)
        self.draft.calls += self.calls
        self.draft.rows += self.rows
        self.draft.compute_s += self.cpu_s
        self.actions += [Emit(rid, [7]), Finish(rid, "length", RequestStats(steps=1))]

    def poll(self) -> list:
        out, self.actions = self.actions, []
        return out


@pytest.mark.parametrize("draft_time, want_ms", [
    ((4.0, 0.5), 3 * 4.0 + 10 * 0.5),           # modelled: A per call + B per row, per request
    ((0.0, 0.0), 0.0),
    (("measured", 2.0), 0.25 * 1e3 * 2.0),      # measured CPU time x scale, counters ignored
])
def test_simulated_pipeline_charges_the_draft_time_model(draft_time, want_ms):
    draft = FakeDraft()
    sched = OneWorkScheduler(draft, calls=3, rows=10, cpu_s=0.25)
    pipe = SimulatedPipeline([object()], (100.0, 0.0), num_stages=2, hop_ms=0.3, draft_time=draft_time)
    out = pipe.run(sched, [Request("a", [1], 1), Request("b", [1], 1)], draft=draft)
    # the coordinator runs one request's draft work after the other: b's token waits for a's draft work too
    assert out["a"].token_times == [pytest.approx(want_ms)]
    assert out["b"].token_times == [pytest.approx(2 * want_ms)]
    assert pipe.draft_ms == pytest.approx(2 * want_ms)


class EchoRunner:
    """A stage that takes time only: the micro-batch comes back as it went in, one row computed."""

    def step(self, batch):
        return SimpleNamespace(batch=batch, trace=[SimpleNamespace(rows_computed=1)])


class ResultDuringDraft:
    """On add: one micro-batch leaves, and two rounds of deferred draft work are due (one draft call each).
    The micro-batch's result emits the token and finishes the request."""

    def __init__(self, draft: FakeDraft) -> None:
        self.draft, self.rounds, self.actions = draft, 0, []
        self.worked_at_result = -1

    def add(self, r: Request) -> None:
        self.rid, self.rounds = r.request_id, 2
        self.actions.append(Inject(SimpleNamespace(rows=1)))

    @property
    def has_work(self) -> bool:
        return self.rounds > 0

    def work(self) -> None:
        self.rounds -= 1
        self.draft.calls += 1

    def on_result(self, result) -> None:
        self.worked_at_result = 2 - self.rounds
        self.actions += [Emit(self.rid, [7]), Finish(self.rid, "length", RequestStats(steps=1))]

    def poll(self) -> list:
        out, self.actions = self.actions, []
        return out


def test_a_result_is_handled_between_draft_rounds():
    """Draft rounds of 100 ms; the micro-batch is back at 10 ms, during round 1 (0-100 ms). It is handled
    when round 1 ends, before round 2 — as the engine's scheduler lock admits a waiting result between
    rounds — so the token leaves at 100 ms, not after both rounds at 200 ms."""
    draft = FakeDraft()
    sched = ResultDuringDraft(draft)
    pipe = SimulatedPipeline([EchoRunner()], (10.0, 0.0), num_stages=1, hop_ms=0.0, draft_time=(100.0, 0.0))
    out = pipe.run(sched, [Request("a", [1], 1)], draft=draft)
    assert out["a"].token_times == [pytest.approx(100.0)]
    assert sched.worked_at_result == 1


class DraftBeside:
    """A scheduler whose draft runs beside it (drafts_beside): on add one micro-batch leaves and a draft job of
    one model call is due; the micro-batch's result emits the token and finishes the request."""
    drafts_beside = True

    def __init__(self, draft: FakeDraft) -> None:
        self.draft, self.actions, self.has_work, self.drafted_at_result = draft, [], False, None

    def add(self, request: Request) -> None:
        self.rid = request.request_id
        self.actions.append(Inject(SimpleNamespace(batch_id=0)))
        self.has_work = True

    def draft_job(self):
        self.has_work = False

        def steps(draft):                  # (DraftJob.steps: a generator returning the results)
            draft.calls += 1
            return DraftResults()
            yield                              # no chained rounds to pause at
        return SimpleNamespace(steps=steps)

    def draft_next(self, job, results):
        self.done = results
        return None

    def on_result(self, result) -> None:
        self.drafted_at_result = hasattr(self, "done")
        self.actions += [Emit(self.rid, [7]), Finish(self.rid, "length", RequestStats(steps=1))]

    def poll(self) -> list:
        out, self.actions = self.actions, []
        return out


def test_the_draft_runs_beside_the_coordinator():
    """A 100 ms draft job starts with the micro-batch (10 ms stage); the result is handled when it comes back
    at 10 ms, not after the job (as in line: test_a_result_is_handled_between_draft_rounds)."""
    draft = FakeDraft()
    sched = DraftBeside(draft)
    pipe = SimulatedPipeline([EchoRunner()], (10.0, 0.0), num_stages=1, hop_ms=0.0, draft_time=(100.0, 0.0))
    out = pipe.run(sched, [Request("a", [1], 1)], draft=draft)
    assert out["a"].token_times == [pytest.approx(10.0)] and sched.drafted_at_result is False
    assert draft.calls == 1 and pipe.draft_ms == pytest.approx(100.0)


class SlowChain:
    """pp-like, one request of `n` tokens, one micro-batch at a time; each result costs the coordinator
    `own_s` of its own time and `draft_s` of draft compute (counted in the draft's `compute_s`)."""

    def __init__(self, draft: FakeDraft, n: int, own_s: float, draft_s: float) -> None:
        self.draft, self.n, self.own_s, self.draft_s, self.actions = draft, n, own_s, draft_s, []
        self.has_work = False

    def add(self, request: Request) -> None:
        self.rid = request.request_id
        self.actions.append(Inject(SimpleNamespace(batch_id=0)))

    def on_result(self, result) -> None:
        time.sleep(self.own_s)                 # the coordinator's own work (measured, charged as control)
        started = time.perf_counter()
        time.sleep(self.draft_s)               # draft compute: the draft-time model charges it instead
        self.draft.compute_s += time.perf_counter() - started
        self.n -= 1
        self.actions.append(Emit(self.rid, [7]))
        self.actions.append(Inject(SimpleNamespace(batch_id=0)) if self.n else Finish(self.rid, "length", RequestStats()))

    def poll(self) -> list:
        out, self.actions = self.actions, []
        return out


def test_the_simulated_clock_charges_measured_control_time():
    """S = 1, a 10 ms stage, no hops: each token is one stage step. With the control time charged, each
    result's 2 ms of the coordinator's own work delays the next micro-batch by it (about 2 ms more between
    tokens); the 3 ms of draft compute in the same call is not control time (the draft model is charged
    by its own time model: free here)."""
    runs = {}
    for scale in (0.0, 1.0):
        draft = FakeDraft()
        pipe = SimulatedPipeline([EchoRunner()], (10.0, 0.0), num_stages=1, hop_ms=0.0, draft_time=(0.0, 0.0),
                                 control_scale=scale)
        runs[scale] = (pipe.run(SlowChain(draft, 6, 0.002, 0.003), [Request("a", [1], 6)], draft=draft)["a"],
                       pipe)
    free, charged = runs[0.0][0], runs[1.0][0]
    assert free.tbt_ms == pytest.approx(10.0)
    assert 2.0 <= charged.tbt_ms - free.tbt_ms < 2.9 + 3.0, "2 ms of control per step, the 3 ms of draft not"
    summary = runs[1.0][1].steps.summary()
    assert len(runs[1.0][1].steps.steps) == 6 and 2.0 <= summary["control_ms_per_step_p50"] < 5.0
    assert summary["draft_ms_per_step_p50"] == 0.0 and runs[0.0][1].steps.summary()["control_ms_total"] == 0.0


def test_step_meter_buckets_by_result():
    from coordinator.engine.meter import StepMeter
    m = StepMeter()
    m.add(1.0, 5.0)                       # before the first result: startup
    m.add(0.5, 2.0, result=True)          # step 1
    m.add(0.25, 1.0)                      # its work round
    m.add(2.0, 0.0, result=True)          # step 2
    assert [(s.control_ms, s.draft_ms) for s in m.steps] == [(0.75, 3.0), (2.0, 0.0)]
    s = m.summary()
    assert s["control_ms_per_step_p50"] == pytest.approx(1.375) and s["control_ms_per_step_p90"] == pytest.approx(1.875)
    assert s["control_ms_total"] == pytest.approx(3.75) and s["draft_ms_total"] == pytest.approx(8.0)


def test_an_open_loop_submits_each_request_at_its_own_time():
    """Draft work of 3 calls over 10 rows at (4 ms, 0.5 ms) = 17 ms per request. a arrives at 0 (token at 17),
    c at 5 while the coordinator is still busy with a (handled at 17, token at 34: 29 ms to first token), b at
    100 on an idle coordinator (token at 117). Time to first token counts from each request's own arrival."""
    draft = FakeDraft()
    sched = OneWorkScheduler(draft, calls=3, rows=10, cpu_s=0.0)
    pipe = SimulatedPipeline([object()], (100.0, 0.0), num_stages=2, hop_ms=0.3, draft_time=(4.0, 0.5))
    reqs = [Request("a", [1], 1), Request("c", [1], 1), Request("b", [1], 1)]
    out = pipe.run(sched, reqs, draft=draft, arrive_ms=[0.0, 5.0, 100.0])
    assert [out[r].token_times for r in "acb"] == [[pytest.approx(17.0)], [pytest.approx(34.0)], [pytest.approx(117.0)]]
    assert [out[r].start_ms for r in "acb"] == [0.0, 5.0, 100.0]
    assert [out[r].ttft_ms for r in "acb"] == [pytest.approx(17.0), pytest.approx(29.0), pytest.approx(17.0)]


def test_open_loop_arrivals_are_checked():
    pipe = SimulatedPipeline([object()], (1.0, 0.0), num_stages=1, draft_time=(0.0, 0.0))
    reqs = [Request("a", [1], 1), Request("b", [1], 1)]
    for bad in ([0.0], [0.0, -1.0], [0.0, float("nan")]):
        with pytest.raises(ValueError, match="arrive_ms"):
            pipe.run(OneWorkScheduler(FakeDraft(), 1, 1, 0.0), reqs, arrive_ms=bad)
    with pytest.raises(ValueError, match="no clients"):
        pipe.run(OneWorkScheduler(FakeDraft(), 1, 1, 0.0), reqs, clients=1, arrive_ms=[0.0, 1.0])


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate():
    times = poisson_arrivals(20_000, 4.0, seed=3)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and min(gaps) >= 0.0
    assert sum(gaps) / len(gaps) == pytest.approx(250.0, rel=0.03)          # 1 / (4 per second)
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(250.0 * 0.6931, rel=0.05)  # exponential median: ln 2 / rate
    assert poisson_arrivals(5, 4.0, seed=3) == times[:5] and poisson_arrivals(5, 4.0, seed=4) != times[:5]
    assert poisson_arrivals(0, 1.0) == []
    for n, rate in ((-1, 1.0), (3, 0.0), (3, -2.0)):
        with pytest.raises(ValueError, match="rate"):
            poisson_arrivals(n, rate)


def test_simulated_pipeline_rejects_a_bad_model():
    with pytest.raises(ValueError, match="draft time model"):
        SimulatedPipeline([object()], (1.0, 0.0), draft_time=(-1.0, 0.0))
    with pytest.raises(ValueError, match="scale"):
        SimulatedPipeline([object()], (1.0, 0.0), draft_time=("measured", -1.0))


# -- the counters ------------------------------------------------------------------------------------------------
def test_model_draft_counts_calls_and_rows(tiny_model):
    from coordinator.core.drafts.model import ModelDraft
    from coordinator.core.drafts.ngram import NgramDraft
    from services.model.shard import load_causal_lm

    d = ModelDraft(load_causal_lm(str(tiny_model), torch.float32, "cpu"))
    assert (d.calls, d.rows) == (0, 0)
    d.begin("r", [5, 6, 7])                                  # prefill of nodes 0, 1: one call, 2 rows
    assert (d.calls, d.rows) == (1, 2)
    d.begin("s", [9])                                        # nothing to prefill: no call
    assert (d.calls, d.rows) == (1, 2)
    d.expand_many([("r", [DraftNode(2, 1, 2, 7)]), ("s", [DraftNode(0, -1, 0, 9)])], k=2)   # one call, 2 rows
    assert (d.calls, d.rows) == (2, 4)
    d.expand_many([("r", [])], k=2)                          # no nodes: no call
    assert (d.calls, d.rows) == (2, 4)

    n = NgramDraft()                                         # no model: free on the simulated clock
    n.begin("r", [5, 6, 5, 6])
    n.expand("r", [DraftNode(3, 2, 3, 6)], k=2)
    assert (n.calls, n.rows) == (0, 0)


# -- end to end: results.json and the charged time ---------------------------------------------------------------
def _sim(tiny_model8, tmp_path, draft_time_ms: str, name: str, methods=("pp", "sps"), control_time="0") -> dict:
    from coordinator.bench.run import write_results
    from coordinator.bench.sim import run_simulated
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}))
    cfg = BenchConfig(stages=[2], methods=list(methods), widths=[4], policies=["hybrid"], stage_time_ms="10",
                      max_new_tokens=6, prompts=str(prompts), num_prompts=0, out=str(tmp_path / name),
                      model=str(tiny_model8), draft="quant", draft_time_ms=draft_time_ms, control_time=control_time)
    write_results(run_simulated(cfg, log=lambda m: None), cfg.out)
    return json.loads((tmp_path / name / "results.json").read_text())


def test_simulated_bench_records_and_charges_the_model(tiny_model8, tmp_path):
    free, costly, default = (_sim(tiny_model8, tmp_path, spec, name)
                             for spec, name in (("0", "free"), ("7+0.5", "costly"), ("", "default")))
    assert costly["config"]["draft_time_model"] == \
        "modelled 7 ms per draft call + 0.5 ms per row (--draft-time-ms 7+0.5)"
    assert costly["config"]["draft_time_ms"] == {"per_call_ms": 7.0, "per_row_ms": 0.5}
    assert default["config"]["draft_time_model"] == "modelled 3 ms per draft call + 0 ms per row (0.3 x stage time)"
    rows = {name: {r["label"]: r for r in res["rows"]} for name, res in
            (("free", free), ("costly", costly), ("default", default))}
    for by in rows.values():
        assert by["pp"]["draft_share"] == 0.0 and by["pp"]["draft_calls_per_step"] == 0.0
        assert by["pp"]["control_warm_ms_per_step_p50"] is None          # no control charged: nothing replayed
        assert by["pp"]["machine_bound"] is False and by["sps"]["compute_ms_per_step"] is None
    assert rows["free"]["pp"]["tbt_ms_mean"] == rows["costly"]["pp"]["tbt_ms_mean"]     # pp runs no draft
    free_sps, sps = rows["free"]["sps"], rows["costly"]["sps"]
    assert free_sps["tokens"] == sps["tokens"] == 6 and free_sps["draft_share"] == 0.0
    calls, draft_rows = sps["draft_calls_per_step"] * sps["steps"], sps["draft_rows_per_step"] * sps["steps"]
    assert calls >= 1 and draft_rows >= calls
    # the draft time charged is exactly 7 ms per call + 0.5 ms per row, and sps waits for its draft each trip
    assert sps["draft_share"] * sps["wall_s"] * 1e3 == pytest.approx(7.0 * calls + 0.5 * draft_rows)
    assert sps["tbt_ms_mean"] > free_sps["tbt_ms_mean"]


def test_simulated_bench_reports_the_replayed_control_time(tiny_model8, tmp_path):
    """With control time charged, rows of methods whose draft runs beside the coordinator (or that have none)
    carry the replayed (warm) control time per step; a trip baseline, whose draft runs in line, does not."""
    res = _sim(tiny_model8, tmp_path, "0", "warm", methods=("pp", "specpipe", "sps"), control_time="measured")
    rows = {r["method"]: r for r in res["rows"]}
    for method in ("pp", "specpipe"):
        assert rows[method]["control_warm_ms_per_step_p50"] > 0 and rows[method]["control_ms_per_step_p50"] > 0
    assert rows["sps"]["control_warm_ms_per_step_p50"] is None
    # the cost rule's last choice per request: width 4 pinned, topk min(16, max(4, width)) = 4; none for pp
    assert (rows["specpipe"]["sized_widths"], rows["specpipe"]["sized_topks"]) == ([4], [4])
    assert (rows["pp"]["sized_widths"], rows["pp"]["sized_topks"]) == ([], [])


# -- real runs: machine-bound --------------------------------------------------------------------------------------
def _stats(stage_ms: list[float], draft_ms: float = 0.0, batches: int = 10) -> dict:
    s = {"tbt_ms": 100.0, "ttft_ms": 100.0, "tokens": 5, "steps": 10, "wall_ms": 1000.0, "batches": batches,
         "draft_ms": draft_ms, "stage0_rows_computed": 10 * batches}   # 10 rows per batch
    s.update({f"stage{i}_compute_ms": c for i, c in enumerate(stage_ms)})
    return s


def test_machine_bound_from_hand_made_stats():
    # 2 stages: 1500 + 1000 ms over 10 batches = 250 ms/step, no draft; the emulated step is 120 ms
    row = summarize(Variant("pp"), 2, [_stats([1500.0, 1000.0])], (120.0, 0.0), cores=2)
    assert row["compute_ms_per_step"] == pytest.approx(250.0) and row["machine_bound"] is True
    text = table({"config": {}, "rows": [row]})
    assert "machine-bound: compute 250 ms/step > 2 cores x 120 ms" in text
    assert summarize(Variant("pp"), 2, [_stats([1500.0, 1000.0])], (120.0, 0.0), cores=3)["machine_bound"] is False
    # the draft's compute counts: 100 + 100 + 50 ms/step (draft 500 ms over 10 batches) > 2 x 120 ms
    row = summarize(Variant("sps"), 2, [_stats([1000.0, 1000.0], draft_ms=500.0)], (120.0, 0.0), cores=2)
    assert row["compute_ms_per_step"] == pytest.approx(250.0) and row["machine_bound"] is True
    row = summarize(Variant("sps"), 2, [_stats([1000.0, 1000.0])], (120.0, 0.0), cores=2)
    assert row["machine_bound"] is False and "machine-bound" not in table({"config": {}, "rows": [row]})
    # the per-row term: 120 + 2 ms x 10 rows per batch = 140 ms emulated, 2 cores x 140 = 280 > 250
    assert summarize(Variant("pp"), 2, [_stats([1500.0, 1000.0])], (120.0, 2.0), cores=2)["machine_bound"] is False
    # no emulated stage time: nothing to compare against
    assert summarize(Variant("pp"), 2, [_stats([1500.0, 1000.0])], (0.0, 0.0), cores=2)["machine_bound"] is None


async def test_the_gpu_regime_preset_and_its_flags():
    from coordinator.bench.run import config_from_args
    from coordinator.cli.main import build_parser, cmd_bench
    cfg = config_from_args(build_parser().parse_args(["bench", "--simulate", "--regime", "gpu"]))
    assert (cfg.stages, cfg.stage_time_ms, cfg.draft_time_ms, cfg.hop_ms) == ([8], "5+0.025", "1.5+0.005", 0.5)
    assert cfg.control_scale == 1.0                                   # the control time is charged by default
    cfg = config_from_args(build_parser().parse_args(["bench", "--simulate", "--regime", "gpu", "--stages", "4",
                                                      "--stage-time-ms", "3", "--hop-ms", "0",
                                                      "--control-time", "0"]))
    assert (cfg.stages, cfg.stage_time_ms, cfg.draft_time_ms, cfg.hop_ms, cfg.control_scale) == \
        ([4], "3", "1.5+0.005", 0.0, 0.0)                            # explicit flags win over the preset
    cfg = config_from_args(build_parser().parse_args(["bench"]))
    assert (cfg.stages, cfg.stage_time_ms, cfg.draft_time_ms, cfg.hop_ms) == ([8], "120", "", 0.3)
    for flags in (["--regime", "gpu"], ["--hop-ms", "1"], ["--control-time", "0"]):
        with pytest.raises(ValueError, match="simulated clock: add --simulate"):
            await cmd_bench(build_parser().parse_args(["bench", *flags]))
    with pytest.raises(ValueError, match="hop"):
        BenchConfig(stages=[2], methods=["pp"], widths=[4], policies=["hybrid"], hop_ms=-1.0)


# -- the cost rule on the simulated clock (coordinator/core/sizing.py) -----------------------------------------------
@pytest.mark.parametrize("profile, S, stage, draft_time, hop, speculates", [
    ("gpu", 8, (5.0, 0.025), (1.5, 0.005), 0.5, True),         # cheap rows and draft: speculation pays
    ("cpu", 4, (28.0, 0.5), (224.0, 0.5), 1.0, False),         # a draft twice the target's cost: none
])
def test_the_cost_rule_sizes_specpipe_to_the_clock(tiny_model, tiny_hf, profile, S, stage, draft_time, hop,
                                                   speculates):
    """Defaults (width, topk and rounds left to the rule), one rule across three requests as the engine keeps
    it: the last request runs speculating on the GPU-like clock and plain on the CPU-like one (there a step
    takes at least a draft call, 224 ms, for at most one token; plain pipelining 4 x 29.5 ms; with a draft
    only as costly as the target the two are within the rule's 10% and either may stay); every output is the
    target's greedy output."""
    from coordinator.core.drafts.model import ModelDraft, quantized_copy
    from coordinator.core.schedulers.registry import SpecOptions, make_scheduler
    from helpers.reference import hf_greedy, prompts
    from helpers.shard import make_runners
    draft = ModelDraft(quantized_copy(str(tiny_model)), name="quant")
    runner = make_runners(tiny_model, 1)[0]
    sizer = None
    for i, prompt in enumerate(prompts(3, seed=4)):
        sched = make_scheduler("specpipe", S, SpecOptions(draft), sizer)
        sizer = sched.sizer
        pipe = SimulatedPipeline([runner], stage, num_stages=S, hop_ms=hop, draft_time=draft_time, control_scale=0)
        out = pipe.run(sched, [Request(f"{profile}{i}", prompt, 40)], draft=draft)[f"{profile}{i}"]
        assert out.tokens == hf_greedy(tiny_hf, prompt, 40)
    assert sizer.choice.speculates is speculates
    assert (out.stats.sized_width > 0) is speculates
    # the tiny model's int8-weight draft has the target's token first (>= COVER): topk 1, a chain (the default
    # `--stage-hardware shared`: CHAIN_TOPK)
    assert out.stats.sized_topk == (1 if speculates else 0)


@pytest.mark.parametrize("right", [True, False])
def test_the_cost_rule_takes_the_smallest_topk_that_covers_the_targets_ranks(tiny_model, tiny_hf, right):
    """The GPU-like clock, defaults: a draft that is always right (the target itself) has the target's token at
    rank 0 of every root, so 1 child covers it and the rule takes topk 1 (a chain: stages share cores by
    default, CHAIN_TOPK); the int8 draft with its proposals
    reversed has it at the last ranks and keeps all 16. Every output is the target's greedy output, before and
    after the change."""
    from coordinator.core.schedulers.registry import SpecOptions, make_scheduler
    from helpers.drafts import Reversed, always_right
    from helpers.reference import hf_greedy, prompts
    from helpers.shard import make_runners
    draft = always_right(tiny_model) if right else Reversed(tiny_model)
    runner = make_runners(tiny_model, 1)[0]
    sizer, topks = None, []
    for i, prompt in enumerate(prompts(3, seed=4)):
        sched = make_scheduler("specpipe", 8, SpecOptions(draft), sizer)
        sizer = sched.sizer
        pipe = SimulatedPipeline([runner], (5.0, 0.025), num_stages=8, hop_ms=0.5, draft_time=(1.5, 0.005),
                                 control_scale=0)
        out = pipe.run(sched, [Request(f"k{i}", prompt, 40)], draft=draft)[f"k{i}"]
        assert out.tokens == hf_greedy(tiny_hf, prompt, 40)
        topks.append(out.stats.sized_topk)
    # the first prompt ends at the largest topk, or in the rule's trial of none (sized 0: the reversed draft's
    # misses make plain pipelining worth measuring; it goes back to speculating once that is measured)
    assert topks[0] in (16, 0) and topks[-1] == (1 if right else 16), topks
    assert sizer.choice.speculates and sizer.choice.topk == topks[-1]


# -- the control plane's own cost, replayed warm (SimulatedPipeline.replay) -------------------------------------------
class CountingRunner:
    """A stage runner that counts its steps (the replay must compute nothing)."""

    def __init__(self, runner) -> None:
        self.runner, self.steps = runner, 0

    def step(self, batch):
        self.steps += 1
        return self.runner.step(batch)

    def apply(self, control) -> None:
        self.runner.apply(control)


def _recorded_specpipe_run(tiny_model, width=8):
    import copy
    from coordinator.core.drafts.model import ModelDraft, quantized_copy
    from coordinator.core.schedulers.registry import SpecOptions, make_scheduler
    from helpers.reference import prompts
    from helpers.shard import make_runners
    draft = ModelDraft(quantized_copy(str(tiny_model)), name="quant")
    runner = CountingRunner(make_runners(tiny_model, 1)[0])
    sched = make_scheduler("specpipe", 4, SpecOptions(draft, width=width, topk=4, draft_rounds=2))
    twin = copy.deepcopy(sched, {id(draft): draft})
    pipe = SimulatedPipeline([runner], (5.0, 0.025), num_stages=4, hop_ms=0.5, draft_time=(1.5, 0.005),
                             control_scale=1.0, record=True)
    out = pipe.run(sched, [Request("a", prompts(1, seed=3)[0], 24)], draft=draft)["a"]
    return pipe, twin, draft, runner, out


def test_a_replay_repeats_the_runs_calls_without_the_model(tiny_model):
    """The replay makes the same actions as the run (checked call by call inside replay), one step per result,
    and runs neither the stages nor the draft: its times are the control plane's alone."""
    pipe, twin, draft, runner, out = _recorded_specpipe_run(tiny_model)
    assert len(out.tokens) == 24
    names = [c.name for c in pipe.calls]
    assert {"add", "on_result", "draft_job", "draft_next"} <= set(names)     # a job's results and the next job:
    assert "draft_done" not in names                                         # one call
    steps, calls = runner.steps, (draft.calls, draft.rows)
    warm = pipe.replay(twin)
    assert runner.steps == steps and (draft.calls, draft.rows) == calls
    assert len(warm.steps) == len(pipe.steps.steps) == names.count("on_result")
    assert all(s.control_ms > 0 and s.draft_ms == 0 for s in warm.steps)


def test_a_replay_that_diverges_is_refused(tiny_model):
    """A recorded result changed (another target token for every output row) makes other commits: the replay
    says so instead of timing other work."""
    pipe, twin, *_ = _recorded_specpipe_run(tiny_model)
    result = next(c for c in pipe.calls if c.name == "on_result" and c.args[0].argmax)
    result.args[0].argmax = [(t + 1) % 256 for t in result.args[0].argmax]
    with pytest.raises(RuntimeError, match="the replay of on_result made other actions than the run"):
        pipe.replay(twin)


def test_replay_needs_a_recorded_run_of_a_draft_beside_scheduler():
    pipe = SimulatedPipeline([EchoRunner()], (10.0, 0.0), num_stages=1)
    with pytest.raises(RuntimeError, match="record=True"):
        pipe.replay(SlowChain(FakeDraft(), 1, 0.0, 0.0))
    pipe = SimulatedPipeline([EchoRunner()], (10.0, 0.0), num_stages=1, record=True)
    inline = SimpleNamespace(drafts_beside=False, draft=FakeDraft())
    with pytest.raises(ValueError, match="runs its draft in line"):
        pipe.replay(inline)


@pytest.mark.parametrize("draft_ms, stage_ms, cut", [(0.01, 50.0, False), (40.0, 5.0, True)])
def test_a_result_arriving_during_chained_rounds_cuts_them_on_the_simulated_clock(tiny_model, draft_ms, stage_ms,
                                                                                  cut):
    """Chained rounds (coordinator/core/drafts/chain.py) stop at a round's end once a result has come back, as
    the engine's scheduler cuts them (DraftJob.cut). A draft whose rounds fit well inside a stage step runs
    every chain whole (but where it runs out of nodes to expand, near the request's end); one slower than the
    results' pace is cut after each chain's first round, and the rest go in the next job. Exact either way."""
    from coordinator.core.drafts.model import ModelDraft, quantized_copy
    from coordinator.core.schedulers.registry import SpecOptions, make_scheduler
    from helpers.reference import hf_greedy, prompts
    from helpers.shard import make_runners
    draft = ModelDraft(quantized_copy(str(tiny_model)), name="quant")
    sched = make_scheduler("specpipe", 4, SpecOptions(draft, width=4, topk=3, draft_rounds=3))
    seen = []                                  # (rounds the chain was due, rounds run, cut) of each chained job
    apply = sched.draft_next

    def recorded(job, results):
        seen.extend((c.rounds, len(results.chained.get(r, ())), results.cut) for r, c in job.chains.items())
        return apply(job, results)
    sched.draft_next = recorded
    pipe = SimulatedPipeline(make_runners(tiny_model, 1), (stage_ms, 0.0), num_stages=4, hop_ms=0.1,
                             draft_time=(draft_ms, 0.0), control_scale=0.0)
    prompt = prompts(1, seed=3)[0]
    out = pipe.run(sched, [Request("a", prompt, 16)], draft=draft)["a"]
    assert seen and all(due > 1 for due, _, _ in seen)
    if cut:
        assert all(ran == 1 and was_cut for _, ran, was_cut in seen), seen
    else:
        assert not any(was_cut for _, _, was_cut in seen)     # (near the end a chain may run out of nodes)
        assert sum(ran == due for due, ran, _ in seen) > 0.8 * len(seen)
    from services.model.shard import load_causal_lm
    assert out.tokens == hf_greedy(load_causal_lm(str(tiny_model), torch.float32, "cpu"), prompt, 16)
