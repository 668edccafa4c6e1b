"""Plot a measured table of ``benchmarks/results/`` as grouped bars (the pages' figures).

    python benchmarks/plot_results.py benchmarks/results/00-weights-to-logits.md --table parity \
        --y "max abs logit diff" --log --out docs/img/phase0_parity.png

A results file holds each table under a ``## <id>`` heading (benchmarks/results/README.md). This
program reads the table ``--table`` from it: the first column (or ``--x``) labels the groups, and each
``--y`` column (default: every column whose cells are all numbers) is one bar per group. Cells may
carry units or thousands separators (``1,274``, ``3.30 ms``, ``1.7x``): the first number in a cell is
its value. Writes the PNG to ``--out`` (default ``benchmarks/runs/plot_results.png``).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from common import RUNS, save_figure

NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def read_table(path: str | Path, table: str) -> tuple[list[str], list[list[str]]]:
    """``(header cells, rows of cells)`` of the first Markdown table under the heading ``## <table>``.

    Raises:
        ValueError: no such heading, or no table under it.
    """
    lines = Path(path).read_text().splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if re.fullmatch(rf"##\s+{re.escape(table)}\s*", line))
    except StopIteration:
        raise ValueError(f"{path} has no '## {table}' heading") from None
    rows: list[list[str]] = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif rows:
            break
    if len(rows) < 2:
        raise ValueError(f"no table under '## {table}' in {path}")
    return rows[0], rows[1:]


def value(cell: str) -> float | None:
    """The first number in a cell (``"1,274 tok/s"`` -> 1274.0), or None."""
    m = NUMBER.search(cell.replace("`", ""))
    return float(m[0].replace(",", "")) if m else None


def plot(header: list[str], rows: list[list[str]], ys: list[str] | None, x: str | None, title: str,
         log: bool, out: str | Path) -> None:
    """Grouped bars: one group per row (labelled by column ``x``), one bar per column of ``ys``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xi = header.index(x) if x else 0
    if ys is None:
        ys = [h for i, h in enumerate(header) if i != xi and all(value(r[i]) is not None for r in rows)]
    missing = [y for y in ys if y not in header]
    if missing or not ys:
        raise ValueError(f"columns {missing or ys} not in the table's header {header}")
    width = 0.8 / len(ys)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) * len(ys) ** 0.5), 4.0))
    for k, y in enumerate(ys):
        yi = header.index(y)
        vals = [value(r[yi]) for r in rows]
        xs = [i + (k - (len(ys) - 1) / 2) * width for i in range(len(rows))]
        bars = ax.bar(xs, [v or 0.0 for v in vals], width, label=y)
        ax.bar_label(bars, labels=[r[yi].replace("`", "") for r in rows], fontsize=7, rotation=90 if len(rows) > 6 else 0)
    ax.set_xticks(range(len(rows)), [r[xi].replace("`", "") for r in rows], rotation=20, ha="right", fontsize=8)
    if log:
        ax.set_yscale("log")
    if len(ys) > 1:
        ax.legend(fontsize=8)
    else:
        ax.set_ylabel(ys[0])
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a file of benchmarks/results/")
    ap.add_argument("--table", required=True, help="the id of its '## <id>' heading")
    ap.add_argument("--y", action="append", default=None, help="a column to plot (repeatable; default: all numeric)")
    ap.add_argument("--x", default=None, help="the column that labels the groups (default: the first)")
    ap.add_argument("--title", default=None, help="default: the table's id")
    ap.add_argument("--log", action="store_true", help="logarithmic y axis")
    ap.add_argument("--out", default=str(RUNS / "plot_results.png"), help="the PNG to write")
    args = ap.parse_args(argv)
    header, rows = read_table(args.results, args.table)
    plot(header, rows, args.y, args.x, args.title or args.table, args.log, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
