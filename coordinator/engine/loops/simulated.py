"""A scheduler run on a simulated clock (`SimulatedPipeline.run(scheduler, requests)`, for `specpipe bench
--simulate`): a loop that drives a scheduler, not a Transport of the engine. Real stage runners compute every micro-batch (so outputs, hits and misses are
the real ones), but time comes from a latency model instead of waiting, so pipelines of 8–64 stages can be
studied on a small machine in minutes.

Model (all in milliseconds):
- stage i takes `a + b * rows` per micro-batch (the emulated stage time), one micro-batch at a time, FIFO;
- each hop (coordinator -> stage 0, stage -> stage, last stage -> coordinator) adds `hop_ms`;
- the coordinator handles one event at a time; the actions an event produces leave when it is handled. The
  scheduler's deferred draft work runs one round per "work" event, queued behind the events that arrived
  before it, so a result that comes back during a round is handled before the next round — as in the gRPC
  engine, whose scheduler lock lets waiting results in between draft rounds. A round takes, by
  `draft_time`: (A, B) -> A ms per draft model call plus B ms per row those calls computed (modelled, from
  the draft's `calls` and `rows` counters; a draft that runs no model is free), or ("measured", scale) ->
  the draft's measured CPU compute time times `scale`;
- the coordinator's own work (the scheduler's calls less the draft model's compute: tree, verification,
  dispatch; coordinator/engine/meter.py) takes its measured wall time times `control_scale` (0: free, the
  default here; the bench charges it, `--control-time measured`); an event's actions leave once it is handled;
- a scheduler whose draft runs beside it (`drafts_beside`: specpipe) hands out draft jobs: the draft is its
  own resource, one job at a time, started when the coordinator has made it and done after its modelled
  time (plus its KV bookkeeping's measured time times `control_scale`), when the coordinator applies it like
  any event and makes the next job in the same call (`draft_next`). The trip baselines' rounds run in line,
  as above;
- control messages reach every stage at once.

`steps` records, per pipeline step (one result handled and the calls up to the next), the control time and
the modelled draft time charged.

Control time measured in line is that of a coordinator that was doing something else for milliseconds before each
call: here the stage and the draft compute on the same CPU between the scheduler's calls. Such a call is 2-3x
slower than the same call back to back, and not because of the model's weights alone: measured on this 2-core VM
(width 32, 2026-12-07, an ad-hoc replay of a recorded run), a `draft_next` call took 0.20 ms back to back, 0.46
after a 40 MB memory sweep, 0.43 after 10 ms of a Python busy loop that touches almost no memory, 0.72 after 10 ms
of sleep, and 0.53 in line — also with the model's compute moved to a thread pinned to the other core (tried, not
kept: no change). A coordinator that waits for its next event on a GPU host meets the same (idle cores, caches and
predictors cold), so the in-line time is the figure charged, and the warm one is reported beside it: with
`record` the loop keeps every scheduler call and its inputs, and `replay(twin)` runs the same calls on a copy of
the scheduler made before the run, with no model compute in between, timing each: the control plane's own cost,
warm (a StepMeter, once per recorded run). The replay checks that it made the same actions as the run.

    twin = copy.deepcopy(scheduler, {id(draft): draft})   # before the run (the draft is shared, not copied)
    pipe = SimulatedPipeline(..., control_scale=1.0, record=True)
    pipe.run(scheduler, requests, draft=draft)
    pipe.replay(twin).summary()["control_ms_per_step_p50"]   # warm; pipe.steps holds the charged (cold) ones
"""
from __future__ import annotations

import copy
import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from common.batch import MicroBatch, StageTrace
from services.runner import StageRunner

from coordinator.core.schedulers.base import Broadcast, Emit, Finish, Inject, Request, Scheduler
from coordinator.core.stats import RequestStats
from coordinator.engine.meter import StepMeter, timed


@dataclass
class SimOutcome:
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)     # ms on the simulated clock
    reason: str = ""
    stats: RequestStats = field(default_factory=RequestStats)
    start_ms: float = 0.0
    end_ms: float = 0.0

    @property
    def tbt_ms(self) -> float:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0

    @property
    def ttft_ms(self) -> float:
        return self.token_times[0] - self.start_ms if self.token_times else 0.0


class SimulatedPipeline:
    def __init__(self, runners: list[StageRunner], stage_ms: tuple[float, float], num_stages: int | None = None,
                 hop_ms: float = 0.3,
                 draft_time: tuple[float, float] | tuple[str, float] = ("measured", 1.0),
                 control_scale: float = 0.0, record: bool = False) -> None:
        """`runners` compute, in order, at the first len(runners) of `num_stages` simulated stages; the other
        stages only take time. One runner holding every layer is the cheapest way to simulate deep pipelines
        (SmolLM2 has 30 layers, so S=32 cannot be split for real)."""
        num_stages = num_stages or len(runners)
        if not runners or num_stages < len(runners):
            raise ValueError("need at least one runner and no more runners than stages")
        if draft_time[0] == "measured":
            if not draft_time[1] >= 0:
                raise ValueError(f"measured draft time scale {draft_time[1]!r} must be 0 or more")
        elif len(draft_time) != 2 or not all(isinstance(x, (int, float)) and x >= 0 for x in draft_time):
            raise ValueError(f"draft time model {draft_time!r} is neither (A ms per call, B ms per row) with "
                             "A, B >= 0 nor ('measured', scale)")
        if not control_scale >= 0 or not hop_ms >= 0:
            raise ValueError(f"control time scale {control_scale!r} and hop {hop_ms!r} ms must be 0 or more")
        self.runners, self.stage_ms, self.hop_ms, self.draft_time = runners, stage_ms, hop_ms, tuple(draft_time)
        self.num_stages = num_stages
        self.control_scale = control_scale
        self.draft_ms = 0.0         # draft time charged to the coordinator in the last run
        self.control_ms = 0.0       # control time charged to the coordinator in the last run
        self.steps = StepMeter()    # the last run's control and draft time per step
        self.record = record
        self.calls: list[Call] = []  # with `record`: the last run's scheduler calls, for `replay`

    def _draft_counters(self, draft) -> tuple[float, int, int]:
        return (draft.compute_s, draft.calls, draft.rows) if draft is not None else (0.0, 0, 0)

    def _draft_spent(self, before: tuple[float, int, int], after: tuple[float, int, int]) -> float:
        """Milliseconds the draft work between two counter readings takes on the simulated clock."""
        if self.draft_time[0] == "measured":
            return (after[0] - before[0]) * 1e3 * self.draft_time[1]
        per_call, per_row = self.draft_time
        return per_call * (after[1] - before[1]) + per_row * (after[2] - before[2])

    def run(self, scheduler: Scheduler, requests: list[Request], draft=None,
            clients: int | None = None, arrive_ms: list[float] | None = None) -> dict[str, SimOutcome]:
        """Run requests to completion on the simulated clock: all arriving at time 0, in order; or with
        `clients` = c a closed loop — c requests at time 0, and each time one finishes the next in order
        arrives (c clients sending one request after another); or with `arrive_ms` an open loop — request i
        arrives at arrive_ms[i] whatever the pipeline is doing (e.g. Poisson arrivals, bench/common.py).
        `draft` is the scheduler's draft source, whose work is charged to the coordinator by `draft_time`."""
        if arrive_ms is not None and (clients or len(arrive_ms) != len(requests) or
                                      any(not t >= 0 for t in arrive_ms)):
            raise ValueError("arrive_ms needs one time >= 0 per request and no clients")
        S = self.num_stages
        events: list = []
        seq = itertools.count()
        queues: list[deque[MicroBatch]] = [deque() for _ in range(S)]
        busy = [False] * S
        coord_free = 0.0
        out = {r.request_id: SimOutcome() for r in requests}
        live = set(out)
        self.draft_ms = self.control_ms = 0.0
        self.steps = StepMeter()
        self.calls = []
        waiting = deque(requests[clients:] if clients else [])
        arrivals: list[float] = []          # finish times at which the next waiting request arrives
        sent_at: dict[int, float] = {}      # micro-batch id -> when it was injected (for its trip_ms)

        def push(t: float, kind: str, payload) -> None:
            heapq.heappush(events, (t, next(seq), kind, payload))

        def dispatch(t: float, actions: list) -> None:
            for action in actions:
                if isinstance(action, Inject):
                    sent_at[getattr(action.batch, "batch_id", None)] = t
                    push(t + self.hop_ms, "arrive", (0, action.batch))
                elif isinstance(action, Broadcast):
                    for r in self.runners:             # control reaches every stage at once
                        r.apply(action.control)
                elif isinstance(action, Emit):
                    o = out[action.request_id]
                    o.tokens.extend(action.token_ids)
                    o.token_times.extend([t] * len(action.token_ids))
                elif isinstance(action, Finish):
                    o = out[action.request_id]
                    o.reason, o.stats, o.end_ms = action.reason, action.stats, t
                    live.discard(action.request_id)
                    if waiting:
                        arrivals.append(t)

        work_due = False            # a "work" event is queued

        concurrent = getattr(scheduler, "drafts_beside", False)   # the draft runs beside the coordinator
        charge = getattr(scheduler, "charge_control", None)       # (test doubles may have none)
        draft_free = 0.0                               # when the draft (its own resource) is idle again
        drafting = False                               # a job is on the draft

        def call(fn, *args, result: bool = False) -> tuple[object, list, float, float]:
            """fn(*args) and poll, timed: (fn's result, actions, control ms charged, draft ms charged)."""
            before = self._draft_counters(draft)
            kept = _keep(fn.__name__, args) if self.record else None     # (copied before the call may change it)
            (out, actions), control, _ = timed(lambda: (fn(*args), scheduler.poll()), draft=draft)
            spent = self._draft_spent(before, self._draft_counters(draft))
            control *= self.control_scale
            if charge is not None:                     # as the engine does: the requests' stats, the cost rule
                charge(control)
            if kept is not None:
                self.calls.append(Call(fn.__name__, kept, control, result, _signature(actions)))
            self.steps.add(control, spent, result=result)
            self.control_ms += control
            self.draft_ms += spent
            return out, actions, control, spent

        def handle(t: float, fn, *args, result: bool = False) -> float:
            """The coordinator handles one event at t; then the draft's next round starts (beside it), or is
            queued as a "work" event behind the events that arrived before it (in line, the trip
            baselines). Returns when the coordinator is free again."""
            nonlocal work_due
            _, actions, control, spent = call(fn, *args, result=result)
            t += control + spent
            dispatch(t, actions)
            if concurrent:
                return start_draft(t)
            if scheduler.has_work and not work_due:
                work_due = True
                push(t, "work", None)
            return t

        def start_draft(t: float) -> float:
            """If the draft is idle and a round is due, the coordinator makes the job (its control time) and
            the draft starts it (`launch`). Returns when the coordinator is free again."""
            if drafting or not scheduler.has_work:
                return t
            job, actions, control, _ = call(scheduler.draft_job)
            t += control
            dispatch(t, actions)
            return launch(t, job)

        def drafted(t: float, job, results) -> float:
            """A job came back: the coordinator applies it and, in the same call (`draft_next`), makes the next
            job, which the draft starts. Returns when the coordinator is free again."""
            nonlocal drafting
            drafting = False
            job, actions, control, _ = call(scheduler.draft_next, job, results)
            t += control
            dispatch(t, actions)
            return launch(t, job)

        def launch(t: float, job) -> float:
            """The draft starts `job` (None: nothing) as soon as it is idle; its results come back when the
            draft-time model says. Returns when the coordinator is free again (at t: the draft is its own)."""
            nonlocal drafting
            if job is not None:
                drafting = True
                advance(max(t, draft_free), job, job.steps(draft), 0.0)
            return t

        def advance(t: float, job, steps, spent: float) -> None:
            """The draft computes the job on from t: up to its end ("drafted"), or to the end of a chained
            round ("round", then on from there): a result handled meanwhile cuts the job's other rounds
            (DraftJob.cut), as on the engine. `spent`: the job's draft time so far."""
            nonlocal draft_free
            before = self._draft_counters(draft)
            try:
                next(steps)
            except StopIteration as done:
                results = done.value
                # the draft's modelled time, and its own Python's measured time (KV bookkeeping, the chains'
                # choices: charged like control time, all of it at the job's end, so a chained round ends
                # that much early and a cut may come a little early)
                last = self._draft_spent(before, self._draft_counters(draft)) + \
                    (results.bookkeeping_ms + results.select_ms) * self.control_scale
                spent += last
                self.steps.add(0.0, spent)
                self.draft_ms += spent
                draft_free = t + last
                results.compute_ms = spent          # the scheduler sees the draft's modelled time
                push(draft_free, "drafted", (job, results))
                return
            now = self._draft_spent(before, self._draft_counters(draft))
            push(t + now, "round", (job, steps, spent + now))

        def work(t: float) -> float:
            """One round of draft work from t; the next round queues behind what arrived meanwhile."""
            nonlocal work_due
            work_due = False
            _, actions, control, spent = call(scheduler.work)
            t += control + spent
            dispatch(t, actions)
            if scheduler.has_work:
                work_due = True
                push(t, "work", None)
            return t

        def admit(t: float) -> None:
            while arrivals:
                arrivals.pop()
                if waiting:            # two requests may end in one event with one request left to send
                    push(t, "submit", waiting.popleft())

        if arrive_ms is not None:
            for r, t in zip(requests, arrive_ms):
                push(t, "submit", r)
        else:
            for r in (requests[:clients] if clients else requests):
                out[r.request_id].start_ms = coord_free
                coord_free = handle(coord_free, scheduler.add, r)
            admit(coord_free)
        def start(i: int, t: float) -> None:
            """Stage i takes its next micro-batch at t; rows pruned by then are dropped, as on a real stage."""
            busy[i] = True
            batch = queues[i].popleft()
            if i < len(self.runners):
                result = self.runners[i].step(batch)
                rows = result.trace[-1].rows_computed
                result.trace[-1].compute_ms = self.stage_ms[0] + self.stage_ms[1] * rows   # the modelled step
            else:                                      # a timing-only stage
                result, rows = batch, batch.rows
                result.trace.append(StageTrace(i, rows, rows, self.stage_ms[0] + self.stage_ms[1] * rows))
            push(t + self.stage_ms[0] + self.stage_ms[1] * rows, "done", (i, result))

        while events and live:
            t, _, kind, payload = heapq.heappop(events)
            if kind == "arrive":
                i, batch = payload
                queues[i].append(batch)
                if not busy[i]:
                    start(i, t)
            elif kind == "done":
                i, result = payload
                busy[i] = False
                push(t + self.hop_ms, "arrive" if i + 1 < S else "result", (i + 1, result) if i + 1 < S else result)
                if queues[i]:
                    start(i, t)
            elif kind == "result":
                payload.trip_ms, payload.arrived_ms = t - sent_at.pop(getattr(payload, "batch_id", None), t), t
                coord_free = handle(max(t, coord_free), scheduler.on_result, payload, result=True)
                admit(coord_free)
            elif kind == "work":
                coord_free = work(max(t, coord_free))
                admit(coord_free)
            elif kind == "round":
                advance(t, *payload)
            elif kind == "drafted":
                coord_free = drafted(max(t, coord_free), *payload)
                admit(coord_free)
            elif kind == "submit":
                out[payload.request_id].start_ms = t
                coord_free = handle(max(t, coord_free), scheduler.add, payload)
                admit(coord_free)
        if live:
            raise RuntimeError(f"simulation ended with requests still running: {sorted(live)}")
        return out

    def replay(self, twin: Scheduler) -> StepMeter:
        """The recorded calls again on `twin` (a copy of the scheduler made before the run), back to back with
        no model compute between them: the control time of each, warm, by step. Raises RuntimeError when the
        replay's actions differ from the run's (then the times would be of other work)."""
        if not self.record:
            raise RuntimeError("replay needs a run with record=True")
        if not replayable(twin):
            raise ValueError("a scheduler that runs its draft in line cannot be replayed without the model")
        meter, jobs = StepMeter(), deque()
        charge = getattr(twin, "charge_control", None)
        for call in self.calls:                        # (the recorded inputs are copies: handed over as they are)
            args = (jobs.popleft(), call.args[1]) if call.name == "draft_next" else call.args
            start = time.perf_counter()
            out = getattr(twin, call.name)(*args)
            actions = twin.poll()
            meter.add((time.perf_counter() - start) * 1e3 * self.control_scale, result=call.result)
            if call.name in ("draft_job", "draft_next") and out is not None:
                jobs.append(out)
            if charge is not None:                     # the cost rule sees what the run charged: same choices
                charge(call.charged)
            if _signature(actions) != call.actions:
                raise RuntimeError(f"the replay of {call.name} made other actions than the run")
        return meter


def replayable(scheduler: Scheduler) -> bool:
    """Whether a run of this scheduler can be replayed without the model: its draft (if any) runs beside it,
    as jobs whose results the run recorded, not in line inside its calls."""
    return scheduler.drafts_beside or getattr(scheduler, "draft", None) is None


@dataclass
class Call:
    """One scheduler call of a recorded run: its inputs, the control time it was charged, its actions."""
    name: str
    args: tuple
    charged: float
    result: bool
    actions: list[tuple]


def _keep(name: str, args: tuple) -> tuple:
    """A call's inputs as the replay needs them: copies (the scheduler may change what it is given); a draft
    job is the twin's own (its i-th), so only its results are kept."""
    if name == "draft_next":
        return (None, copy.deepcopy(args[1]))
    return copy.deepcopy(args)


def _signature(actions: list) -> list[tuple]:
    """What a replay must repeat: every action's kind and content that names nodes or tokens."""
    out: list[tuple] = []
    for a in actions:
        if isinstance(a, Inject):
            out.append(("inject", tuple((s.request_id, tuple(s.node_ids)) for s in a.batch.segments)))
        elif isinstance(a, Broadcast):
            c = a.control
            out.append(("control", c.request_id, tuple(c.commit), tuple(c.prune), c.release))
        elif isinstance(a, Emit):
            out.append(("emit", a.request_id, tuple(a.token_ids)))
        elif isinstance(a, Finish):
            out.append(("finish", a.request_id, a.reason))
    return out
