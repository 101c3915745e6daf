"""`Coordinator.warm_up` (what `specpipe run --warmup-tokens` calls before the prompt): one generation from a fixed
prompt that teaches specpipe's cost rule what this pipeline costs, ended once the rule has decided; nothing of
it is left but what the rule learnt, and the request after it is exact."""
from __future__ import annotations

from collections import Counter

import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from coordinator.core.sizing import Why

from coordinator.frontends.service import GenerateInput
from helpers.reference import hf_greedy
from helpers.stage_servers import served_coordinator
from helpers.wait import wait_until_empty

pytestmark = pytest.mark.grpc


def _switches() -> dict[str, float]:
    """specpipe_cost_rule_switches_total{method="specpipe"} by why."""
    return {w.label: REGISTRY.get_sample_value("specpipe_cost_rule_switches_total",
                                                      {"method": "specpipe", "why": w.label}) or 0.0
            for w in Why}


async def test_the_warm_up_ends_once_the_rule_has_decided_and_leaves_nothing(tiny_model, tiny_hf):
    async with served_coordinator(str(tiny_model), 2, stage_time_ms="5", max_new_tokens_cap=400) as served:
        coord = served.coord
        sizer = coord.engine.scheduler("specpipe").sizer
        assert not sizer.decided
        before = _switches()
        with capture_logs() as logs:
            seconds = await coord.warm_up(400)
        assert seconds > 0 and sizer.settled and not sizer.trying and not sizer.growing
        # each of the rule's switches over real gRPC is logged once, in order, and counted by why (which ones
        # depends on the machine's pace: the draft-bound start is left here, then none is tried or not)
        switched = [e for e in logs if e["event"] == "cost rule switched"]
        assert 1 <= sizer.switched <= sizer.switches.maxlen and len(switched) == sizer.switched
        assert [e["why"] for e in switched] == [s.why.label for s in sizer.switches]
        assert all(e["method"] == "specpipe" for e in switched)
        made = Counter(s.why.label for s in sizer.switches)
        assert {w: n - before[w] for w, n in _switches().items()} == {w: float(made[w]) for w in before}
        assert coord.engine.active == 0
        await wait_until_empty(served.stages, coord)
        prompt = [5, 6, 7, 8]
        tokens = [t async for c in coord.generate(GenerateInput(prompt_token_ids=prompt, max_new_tokens=12,
                                                                ignore_eos=True)) for t in c.token_ids]
        assert tokens == hf_greedy(tiny_hf, prompt, 12)
        assert REGISTRY.get_sample_value("specpipe_sized_calibration", {"method": "specpipe"}) == \
            pytest.approx(sizer.calibration), "the rule's model fit, as of the request after the warm-up"


async def test_no_warm_up_without_a_rule_or_tokens(tiny_model):
    async with served_coordinator(str(tiny_model), 2, method="pp") as served:
        assert await served.coord.warm_up(64) == 0.0            # pp has no cost rule
    async with served_coordinator(str(tiny_model), 2, width=4, topk=2, draft_rounds=1) as served:
        assert await served.coord.warm_up(64) == 0.0            # all three pinned: no rule
        assert await served.coord.warm_up(0) == 0.0
    async with served_coordinator(str(tiny_model), 2) as served:
        from dataclasses import replace
        served.coord.limits = replace(served.coord.limits, max_position=24)    # the fixed prompt fills it
        assert await served.coord.warm_up(64) == 0.0 and served.coord.engine.active == 0


async def test_a_warm_up_with_settings_warms_the_scheduler_requests_with_them_get(tiny_model):
    """The bench warms each variant's rule up: `spec_overrides` picks the scheduler a request with the same
    overrides runs on, not the default one."""
    from dataclasses import replace
    async with served_coordinator(str(tiny_model), 2, stage_time_ms="5", max_new_tokens_cap=400) as served:
        coord = served.coord
        assert await coord.warm_up(400, "specpipe", {"width": 8}) > 0
        assert coord.engine.scheduler("specpipe", replace(coord.engine.spec, width=8)).sizer.decided
        assert not coord.engine.scheduler("specpipe").sizer.decided
        await wait_until_empty(served.stages, coord)


async def test_a_switch_that_cannot_be_logged_is_warned_of_and_the_results_go_on(tiny_model, monkeypatch):
    """The rule's switches are logged beside the scheduler's results: a failure to log them is a warning (once per
    result that switched), never a stopped pipeline."""
    import coordinator.engine.engine as engine_module

    def broken(method, switches):
        raise OSError("log sink full (simulated)")
    monkeypatch.setattr(engine_module, "log_switches", broken)
    async with served_coordinator(str(tiny_model), 2, stage_time_ms="5", max_new_tokens_cap=400) as served:
        with capture_logs() as logs:
            assert await served.coord.warm_up(400) > 0
        sizer = served.coord.engine.scheduler("specpipe").sizer
        warned = [e for e in logs if e["event"] == "cost rule switches not logged"]
        assert sizer.settled and 1 <= len(warned) <= sizer.switched
        assert all(e["log_level"] == "warning" and "log sink full" in e["error"] for e in warned)
        assert not [e for e in logs if e["event"] == "cost rule switched"]
