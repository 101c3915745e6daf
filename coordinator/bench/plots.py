"""PNG plots of a bench results.json (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def plot(result: dict, out_dir: str | Path) -> list[Path]:
    """Write tbt.png (time between tokens per variant, one group per pipeline depth) and, when several depths
    were run, tbt_vs_stages.png; for a concurrency sweep, throughput_vs_concurrency.png and
    tbt_vs_concurrency.png instead, and for a sweep of request rates throughput_vs_rate.png and tbt_vs_rate.png.
    Returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    rows = result["rows"]
    written: list[Path] = []
    if not rows:
        return written
    stages = sorted({r["stages"] for r in rows})
    labels = list(dict.fromkeys(r["label"] for r in rows))
    emulated = result["config"].get("stage_time_ms", "0")
    note = f"emulated stage time {emulated} ms" if result["config"].get("emulated_stage_time") else "no emulated time"
    if any(r.get("request_rate") for r in rows):
        return _level_plots(plt, rows, out, note, "request_rate", "requests per second (Poisson arrivals)", "rate")
    if len({r.get("concurrency", 1) for r in rows}) > 1:
        return _level_plots(plt, rows, out, note, "concurrency", "concurrent requests", "concurrency")

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels) * len(stages)), 4.5))
    width = 0.8 / len(stages)
    for si, s in enumerate(stages):
        by = {r["label"]: r for r in rows if r["stages"] == s}
        xs = [i + si * width for i, lab in enumerate(labels) if lab in by]
        ys = [by[lab]["tbt_ms_mean"] for lab in labels if lab in by]
        errs = [[0] * len(ys), [by[lab]["tbt_ms_p90"] - by[lab]["tbt_ms_mean"] for lab in labels if lab in by]]
        ax.bar(xs, ys, width, yerr=errs, capsize=3, label=f"S={s}")
    ax.set_xticks([i + width * (len(stages) - 1) / 2 for i in range(len(labels))], labels, rotation=30,
                  ha="right")
    ax.set_ylabel("time between tokens, ms (bar: mean, whisker: p90)")
    ax.set_title(f"Time between tokens per method\n({note})", fontsize=10)
    ax.legend()
    fig.tight_layout()
    written.append(out / "tbt.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    if any(r.get("simulated") for r in rows) and len(stages) == 1:
        written.append(_step_time(plt, rows, out, result["config"].get("hop_ms"), note))
    if len(stages) > 1:
        series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in rows:
            series[r["label"]].append((r["stages"], r["tbt_ms_mean"]))
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for label, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(stages, [str(s) for s in stages])
        ax.set_xlabel("pipeline stages S")
        ax.set_yscale("log")
        ax.set_ylabel("time between tokens, ms (log scale)")
        ax.set_title(f"Time between tokens against pipeline depth\n({note})", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out / "tbt_vs_stages.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def _level_plots(plt, rows: list[dict], out: Path, note: str, level: str, xlabel: str, suffix: str) -> list[Path]:
    """Throughput and time between tokens (p50, p90 dashed) against the load (`level`: the row's concurrency
    or request rate), one line per variant."""
    series: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        series[f"{r['label']} S={r['stages']}"].append(r)
    levels = sorted({r[level] for r in rows})
    written = []
    for name, ylabel, keys in [(f"throughput_vs_{suffix}.png", "throughput, tokens/s", ["throughput_tok_s"]),
                               (f"tbt_vs_{suffix}.png", "time between tokens, ms (p50; p90 dashed)",
                                ["tbt_ms_p50", "tbt_ms_p90"])]:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for label, pts in series.items():
            pts = sorted(pts, key=lambda r: r[level])
            for key in keys:
                ax.plot([p[level] for p in pts], [p[key] for p in pts], marker="o",
                        linestyle="--" if key.endswith("p90") else "-",
                        label=label if key == keys[0] else None)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [f"{c:g}" for c in levels])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel.split(',')[0].capitalize()} against {xlabel.split(' (')[0]}\n({note})", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out / name)
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def step_parts(row: dict, hop_ms: float | None) -> dict[str, float]:
    """Where one pipeline step of a simulated row goes, ms: the stage step at the row's mean rows, the hop,
    the coordinator's control time and the draft's time per step (medians; the draft runs beside the
    coordinator, so its bar is not added to the others), and the step as measured (time between tokens x
    decode tokens per step)."""
    return {"stage": row.get("emulated_stage_ms") or 0.0, "hop": hop_ms or 0.0,
            "control": row.get("control_ms_per_step_p50") or 0.0, "draft": row.get("draft_ms_per_step_p50") or 0.0,
            "step": row["tbt_ms_mean"] * (row.get("decode_tokens_per_step") or row["tokens_per_step"])}


def _step_time(plt, rows: list[dict], out: Path, hop_ms: float | None, note: str) -> Path:
    """step_time.png: per variant, the stage + hop + control bar stacked, the draft's bar beside it, and the
    measured step as a marker."""
    fig, ax = plt.subplots(figsize=(max(6.5, 1.1 * len(rows)), 4.5))
    colors = {"stage": "tab:blue", "hop": "tab:gray", "control": "tab:red", "draft": "tab:green"}
    for i, r in enumerate(rows):
        parts = step_parts(r, hop_ms)
        bottom = 0.0
        for k in ("stage", "hop", "control"):
            ax.bar(i - 0.18, parts[k], 0.34, bottom=bottom, color=colors[k], label=k if i == 0 else None)
            bottom += parts[k]
        ax.bar(i + 0.18, parts["draft"], 0.34, color=colors["draft"], label="draft (beside)" if i == 0 else None)
        ax.plot([i], [parts["step"]], marker="D", color="black", label="measured step" if i == 0 else None)
    ax.set_xticks(range(len(rows)), [r["label"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("ms per pipeline step (medians)")
    ax.set_title(f"Where a pipeline step goes\n({note})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "step_time.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
