"""Plot single-stream reports: TPOT per engine per model, with the batch-1 decode floor marked.

    python benchmarks/plot_single_stream.py benchmarks/runs/single_qwen3-0.6b.json \\
        benchmarks/runs/single_qwen3-4b.json --out docs/img/single_stream_gpu.png
    python benchmarks/plot_single_stream.py benchmarks/runs/single_stream.json \\
        --out docs/img/single_stream_cpu.png

Reads one or more JSON reports written by ``benchmarks/single_stream.py --out`` and draws one
group of bars per (model, prompt length): one bar per engine (infer, HF eager, HF static
cache + torch.compile, whichever the report holds), its height the measured TPOT in ms, its
label the TPOT and the fraction of the floor it reaches (floor / TPOT). A dashed line across each group is
the decode floor of that row (bytes one decode step must read / measured copy bandwidth).
The y axis is logarithmic when the bars span more than a factor of 20, so a 3 ms bar and a
50 ms bar are both readable. Writes the PNG to ``--out`` (default ``benchmarks/runs/single_stream.png``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
from common import out_argument

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ENGINE_LABELS = {
    "infer": "infer",
    "hf-eager": "HF eager",
    "hf-compiled": "HF static cache + compile",
}
ENGINE_COLORS = {"infer": "#1f77b4", "hf-eager": "#ff7f0e", "hf-compiled": "#2ca02c"}


def fmt_ms(v: float) -> str:
    """Three significant digits without dropping a trailing zero (29.0, 3.13, 0.406)."""
    return f"{v:.1f}" if v >= 10 else f"{v:.3g}" if v >= 1 else f"{v:.3f}"


def model_name(report: dict) -> str:
    """A short label for the report's model: the engine_config name, else the path's stem."""
    name = str(report.get("engine_config", {}).get("model") or report.get("model", "?"))
    path = Path(name)
    return path.stem if path.suffix == ".gguf" else path.name


def load_groups(paths: list[Path]) -> tuple[list[dict], list[str]]:
    """One group per (report, prompt length): ``{"label", "floor_ms", "rows": {engine: row}}``."""
    groups: list[dict] = []
    engines: list[str] = []
    for path in paths:
        report = json.loads(path.read_text())
        if report.get("benchmark") != "single_stream":
            raise SystemExit(f"{path}: not a single_stream report")
        dtype = str(report.get("dtype", "")).removeprefix("torch.")
        by_prompt: dict[int, dict] = {}
        for row in report["rows"]:
            g = by_prompt.setdefault(row["prompt"], {"rows": {}, "floor_ms": row["floor_ms"]})
            g["rows"][row["engine"]] = row
            if row["engine"] not in engines:
                engines.append(row["engine"])
        for prompt, g in sorted(by_prompt.items()):
            g["label"] = f"{model_name(report)}\n{dtype}, prompt {prompt}"
            groups.append(g)
    order = [e for e in ENGINE_LABELS if e in engines] + [e for e in engines if e not in ENGINE_LABELS]
    return groups, order


def plot(groups: list[dict], engines: list[str], out: Path, title: str | None) -> None:
    n = len(engines)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6.0, 3.2 * len(groups) + 1.5), 5.2))
    values = [r["tpot_ms"] for g in groups for r in g["rows"].values()] + [g["floor_ms"] for g in groups]
    log = max(values) / min(values) > 20
    for j, engine in enumerate(engines):
        xs, ys, labels = [], [], []
        for i, g in enumerate(groups):
            row = g["rows"].get(engine)
            if row is None:
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(row["tpot_ms"])
            labels.append(f"{fmt_ms(row['tpot_ms'])} ms\n{100 * row['floor_frac']:.1f}% of floor")
        bars = ax.bar(xs, ys, width * 0.92, label=ENGINE_LABELS.get(engine, engine),
                      color=ENGINE_COLORS.get(engine), zorder=2)
        ax.bar_label(bars, labels, fontsize=8, padding=2)
    for i, g in enumerate(groups):
        ax.hlines(g["floor_ms"], i - 0.45, i + 0.45, colors="black", linestyles="dashed", linewidth=1.4,
                  label="batch-1 decode floor (bytes read / bandwidth)" if i == 0 else None, zorder=3)
        ax.annotate(f"floor {fmt_ms(g['floor_ms'])} ms", (i - 0.43, g["floor_ms"]), xytext=(0, 3),
                    textcoords="offset points", ha="left", va="bottom", fontsize=8, zorder=4,
                    bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85))
    ax.set_xticks(range(len(groups)), [g["label"] for g in groups])
    ax.set_xlim(-0.55, len(groups) - 0.45)
    if log:
        ax.set_yscale("log")
        ax.set_ylim(min(values) / 2.5, max(values) * 4)
    else:
        ax.set_ylim(0, max(values) * 1.3)
    ax.set_ylabel("TPOT, ms per output token (lower is better)")
    ax.set_title(title or "Single stream: time per output token (bar label: TPOT, % of floor)", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", type=Path, help="single_stream JSON reports")
    out_argument(ap, "single_stream.png", "PNG to write")
    ap.add_argument("--title", default=None, help="figure title")
    args = ap.parse_args(argv)
    groups, engines = load_groups(args.reports)
    plot(groups, engines, Path(args.out), args.title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
