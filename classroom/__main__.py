"""``python -m classroom``: list, prepare, grade and mutants (see :mod:`classroom.exercises`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from classroom.exercises import MANIFEST, REPO, selected
from classroom.grading import grade, grade_mutants, prepare


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m classroom", description=__import__("classroom.exercises").exercises.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("list", "prepare", "grade", "mutants"):
        p = sub.add_parser(cmd)
        p.add_argument("--phase", type=int, default=None, help="only this phase's exercises")
        p.add_argument("--exercise", action="append", default=None, help="only this exercise (repeatable)")
        if cmd == "prepare":
            p.add_argument("--out", type=Path, required=True, help="new workspace directory")
        if cmd == "grade":
            p.add_argument("--root", type=Path, required=True,
                           help="the workspace to grade (made by `prepare`); without --phase/--exercise, the "
                                "exercises `prepare` recorded there. `--root .` in this repository grades the "
                                "reference solutions themselves")
        if cmd == "mutants":
            p.add_argument("--jobs", type=int, default=2, help="mutants graded at once")
    args = ap.parse_args(argv)
    if args.cmd == "grade":
        args.root = _workspace(args.root.expanduser())
    if args.cmd == "grade" and args.phase is None and not args.exercise:
        results = grade(args.root.expanduser(), None)
        return 0 if all(results.values()) else 1
    chosen = selected(args.phase, args.exercise)
    if args.cmd == "list":
        for e in chosen:
            needs = [n for n in e.needs if n in {c.name for c in chosen}]
            print(f"phase {e.phase}  {e.name:<12} ~{e.minutes} min  {e.file}")
            if needs:
                print(f"    its tests also run: {', '.join(needs)}")
            print(f"    {e.hint}")
        return 0
    if args.cmd == "prepare":
        prepare(args.out.expanduser(), chosen)
        return 0
    if args.cmd == "mutants":
        refs, got = grade_mutants(chosen, args.jobs)
        return 0 if all(refs.values()) and not any(got.values()) else 1
    results = grade(args.root.expanduser(), chosen)
    return 0 if all(results.values()) else 1


def _workspace(root: Path) -> Path:
    """The directory to grade: ``root`` itself if it is a workspace or this repository, else the workspace
    that contains it (a student who runs ``--root .`` from a subfolder of their workspace).

    Raises:
        SystemExit: ``root`` is inside neither (grading a copy that ``prepare`` did not make).
    """
    root = root.resolve()
    for d in (root, *root.parents):
        if (d / MANIFEST).is_file() or d == REPO:
            return d
    raise SystemExit(f"{root} is not a workspace made by `python -m classroom prepare` (no {MANIFEST} in it or "
                     "above it): name the workspace with --root")


if __name__ == "__main__":
    raise SystemExit(main())
