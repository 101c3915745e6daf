"""`specpipe bench --repeats N`: the whole bench run N times, each run's rows kept, the median run reported.

Why. A side-by-side ratio from one run is as firm as the machine is quiet: on the 2-core development VM the same
32-prompt GPU-regime run moved by ±10% within an hour (control time is measured in line), more than most single
changes. Every run interleaves the methods prompt by prompt, so a ratio taken inside one run compares like with
like; N runs give N such ratios and their spread.

What is reported. Rows are matched by position (each run sweeps the same variants in the same order; a run
whose rows differ is refused). Each row is the median run's row — by time between tokens (mean) for one
client, by throughput under load; the lower middle one for an even N — with `runs` added: per metric in
RUN_METRICS, the value of every run in run order. `side_by_side` gives, for every specpipe row, the ratio
against each other method at the same depth and load, run by run, and the median of those ratios (not the
ratio of the medians: each ratio is of one run's side-by-side figures).

Worked example (3 runs, one client):

    specpipe tbt 2.6, 2.5, 2.8 ms; pipeinfer 3.7, 3.8, 3.7 ms
    -> the specpipe row is run 1's (median 2.6), runs["tbt_ms_mean"] = [2.6, 2.5, 2.8]
    -> ratios 3.7/2.6 = 1.42, 3.8/2.5 = 1.52, 3.7/2.8 = 1.32: median 1.42
"""
from __future__ import annotations

import statistics

from coordinator.core.vocabulary import Method

RUN_METRICS = ("tbt_ms_mean", "tbt_ms_p50", "throughput_tok_s", "decode_tokens_per_step",
               "control_ms_per_step_p50")


def _key(row: dict) -> tuple:
    """What identifies a row across runs."""
    return row.get("label"), row.get("stages"), row.get("concurrency"), row.get("request_rate")


def _loaded(row: dict) -> bool:
    return (row.get("concurrency") or 1) > 1 or bool(row.get("request_rate"))


def _n(row: dict) -> int:
    """How many runs a combined row holds (0: a single run's row)."""
    return max((len(v) for v in (row.get("runs") or {}).values()), default=0)


def _median_index(values: list[float]) -> int:
    """The index of the (lower) median value; runs without a value (None) sort last."""
    order = sorted(range(len(values)), key=lambda i: (values[i] is None, values[i] or 0.0))
    return order[(len(values) - 1) // 2]


def combine(results: list[dict]) -> dict:
    """The runs of one bench as one result (module docstring). One run: returned as it is."""
    if not results:
        raise ValueError("no bench run to combine")
    if len(results) == 1:
        return results[0]
    keys = [_key(r) for r in results[0]["rows"]]
    for i, result in enumerate(results[1:], 2):
        if [_key(r) for r in result["rows"]] != keys:
            raise ValueError(f"bench run {i} has other rows than run 1: {[_key(r) for r in result['rows']]} "
                             f"against {keys}")
    rows = []
    for i in range(len(keys)):
        runs = [result["rows"][i] for result in results]
        loaded = _loaded(runs[0])
        by = [(-r["throughput_tok_s"] if r.get("throughput_tok_s") is not None else None) if loaded
              else r.get("tbt_ms_mean") for r in runs]
        row = dict(runs[_median_index(by)])
        row["runs"] = {m: [r.get(m) for r in runs] for m in RUN_METRICS if any(m in r for r in runs)}
        rows.append(row)
    return dict(results[0], rows=rows)


def side_by_side(rows: list[dict]) -> list[str]:
    """Per specpipe row with several runs: its ratio against each other method at the same depth and load,
    run by run (lower time between tokens for one client, throughput under load) and their median."""
    out = []
    for r in rows:
        if r.get("method") != Method.SPECPIPE or _n(r) < 2:
            continue
        for b in rows:
            if b.get("method") == Method.SPECPIPE or _key(b)[1:] != _key(r)[1:] or _n(b) < 2:
                continue
            loaded = _loaded(r)
            metric = "throughput_tok_s" if loaded else "tbt_ms_mean"
            pairs = zip(r["runs"].get(metric, ()), b["runs"].get(metric, ()))
            ratios = [(x / y if loaded else y / x) for x, y in pairs if x and y]
            if not ratios:
                continue
            what = "the throughput" if loaded else "lower time between tokens"
            out.append(f"    S={r['stages']} {r['label']} against {b['label']}, {len(ratios)} runs: "
                       f"{', '.join(f'{x:.2f}x' for x in ratios)} {what} (median {statistics.median(ratios):.2f}x, "
                       f"spread {min(ratios):.2f}-{max(ratios):.2f}x)")
    return out


def spreads(rows: list[dict]) -> list[str]:
    """Per row with several runs: every run's time between tokens (mean; throughput under load) and control time
    per step (p50), in run order."""
    out = []
    for r in rows:
        runs = r.get("runs") or {}
        if _n(r) < 2:
            continue
        metric, unit = ("throughput_tok_s", " tokens/s") if _loaded(r) else ("tbt_ms_mean", " ms")
        text = ", ".join("-" if x is None else f"{x:.2f}" for x in runs.get(metric, ()))
        ctl = [x for x in runs.get("control_ms_per_step_p50", ()) if x is not None]
        out.append(f"    S={r['stages']} {r['label']}: {_n(r)} runs, "
                   f"{'throughput' if _loaded(r) else 'time between tokens'} {text}{unit}"
                   + (f"; control p50 {', '.join(f'{x:.2f}' for x in ctl)} ms" if ctl else ""))
    return out
