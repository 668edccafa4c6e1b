"""The exercise grader: the exercises' regions, markers, mutants and page, and a prepared workspace
graded on exactly its exercises, with the instructor's tests, against the workspace's own code.
(Every reference PASSing and every mutant FAILing is tests/test_exercise_mutants.py.)"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from classroom.exercises import EXERCISES, MANIFEST, REPO, find_regions, region_text, selected, stub
from classroom.grading import grade, grading_env, prepare
from classroom.mutants import _ALL, MUTANTS, apply_mutant


def test_every_marker_is_registered_and_every_exercise_has_a_region():
    found = {}
    for path in (REPO / "src" / "infer").rglob("*.py"):
        for name in find_regions(path.read_text()):
            found[name] = str(path.relative_to(REPO))
    assert found == {name: e.file for name, e in EXERCISES.items()}


def test_stubs_are_valid_python():
    for e in EXERCISES.values():
        text = stub((REPO / e.file).read_text(), e.name, e.hint)
        ast.parse(text)
        assert "NotImplementedError" in text and f"# >>> EXERCISE {e.name}" in text


def test_every_exercise_has_mutants_that_apply():
    """At least two wrong solutions per exercise; each still applies to today's reference (a
    ValueError names a stale one), is valid Python and changes only its region."""
    assert set(MUTANTS) == set(EXERCISES) and all(len(ms) >= 2 for ms in MUTANTS.values())
    assert len({m.id for m in _ALL}) == len(_ALL)
    for m in _ALL:
        text = (REPO / EXERCISES[m.exercise].file).read_text()
        wrong = apply_mutant(text, m)
        ast.parse(wrong)
        assert region_text(wrong, m.exercise) != region_text(text, m.exercise)
        assert stub(wrong, m.exercise, "") == stub(text, m.exercise, "")


def test_the_exercises_page_lists_every_exercise_in_list_order():
    """docs/exercises.md's table of current exercises: one row per registered exercise, in the order
    ``python -m classroom list`` prints them, each naming its file and its number of grading tests."""
    import re

    from classroom.exercises import ordered

    page = (REPO / "docs" / "exercises.md").read_text()
    rows = [line for line in page.split("## Current exercises", 1)[1].splitlines() if re.match(r"\| \d+ \| `", line)]
    names = [re.search(r"`(\w+)`", row).group(1) for row in rows]
    assert names == [e.name for e in ordered(list(EXERCISES.values()))]
    for row, name in zip(rows, names):
        cells = [c.strip() for c in row.strip("|").split("|")]
        e = EXERCISES[name]
        assert (cells[0], cells[2], cells[3]) == (str(e.phase), f"`{e.file}`", str(len(e.tests))), row


def test_needs_name_exercises_and_list_order_puts_independent_ones_first():
    for e in EXERCISES.values():
        assert set(e.needs) <= set(EXERCISES) - {e.name}
    phase5 = [e.name for e in selected(5, None)]
    assert phase5.index("block_free") < phase5.index("slot_mapping")  # slot_mapping's engine test frees blocks
    with pytest.raises(SystemExit, match="no exercise matches"):
        selected(0, ["top_p"])  # top_p is phase 1


def test_a_prepared_workspace_is_graded_on_its_exercises_with_the_instructors_tests(tmp_path, capsys):
    ws = tmp_path / "ws"
    with pytest.raises(SystemExit, match="no exercises"):
        prepare(ws, [])
    prepare(ws, [EXERCISES["apply_rope"]])
    assert json.loads((ws / MANIFEST).read_text()) == {"exercises": ["apply_rope"]}
    # the grader and its mutant table (reference fragments) stay behind; `python -m classroom` there says so
    assert sorted(f.name for f in (ws / "classroom").iterdir()) == ["__init__.py", "__main__.py"]
    there = subprocess.run([sys.executable, "-m", "classroom", "grade"], cwd=ws, capture_output=True, text=True)
    assert there.returncode == 1 and "grade it from the course repository" in there.stderr, there.stderr
    check = subprocess.run([sys.executable, "-c", "import infer.llm, infer.server.app"], cwd=ws,
                           env={"PYTHONPATH": str(ws / "src")}, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr  # everything else still imports
    # the page's command, as written, in the workspace (no PYTHONPATH): it tests the stub, not an
    # installed infer
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "INFER_SRC")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          "tests/test_layers.py::test_apply_rope_is_a_rotation"], cwd=ws, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 1 and "Exercise apply_rope" in run.stdout, run.stdout[-2000:]
    # a student who edits the workspace's tests (here: deletes the assertions) still fails
    (ws / "tests" / "test_layers.py").write_text("def test_apply_rope_is_a_rotation():\n    pass\n")
    (ws / "tests" / "conftest.py").write_text("")
    capsys.readouterr()
    assert grade(ws) == {"apply_rope": False}  # exactly what was prepared, by default
    out = capsys.readouterr().out
    assert "Exercise apply_rope" in out and "score: 0/1" in out
    # an `infer` from outside the workspace is refused
    (ws / "src" / "infer").rename(ws / "src" / "elsewhere")
    with pytest.raises(SystemExit, match="refusing to grade"):
        grading_env(ws)


def test_grade_needs_the_workspace_named(tmp_path, capsys):
    """Grading without --root once graded the repository's reference solutions and printed PASS to a
    student who meant their workspace: --root is required, and must be a workspace (or a folder inside
    one, or the repository itself, deliberately)."""
    from classroom.__main__ import _workspace, main

    with pytest.raises(SystemExit) as e:
        main(["grade", "--exercise", "top_p"])
    assert e.value.code == 2 and "--root" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="not a workspace made by"):
        main(["grade", "--root", str(tmp_path), "--exercise", "top_p"])
    ws = tmp_path / "ws"
    prepare(ws, [EXERCISES["apply_rope"]])
    assert _workspace(ws / "src" / "infer") == ws.resolve() and _workspace(REPO / "docs") == REPO


def _significant_lines(body: str) -> list[str]:
    return [line.strip() for line in body.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_a_workspace_holds_no_reference_solution(tmp_path):
    """Every exercise prepared: no file of the workspace outside ``src/`` (tests, docs pages, scripts,
    benchmarks) contains the body of an exercise region, as three or more consecutive significant lines:
    the pages explain the idea and show the signature, never the solution. (Inside ``src/`` a kernel's
    preamble or a subclass's override may share lines with an exercise: that is the engine's own code.)"""
    ws = tmp_path / "all"
    prepare(ws, list(EXERCISES.values()))
    bodies = {}
    for e in EXERCISES.values():
        lines = _significant_lines(region_text((REPO / e.file).read_text(), e.name))
        if len(lines) >= 3:
            bodies[e.name] = lines
    leaks = []
    for path in ws.rglob("*"):
        if (not path.is_file() or path.suffix not in (".py", ".md", ".txt", ".sh", ".yml", ".toml", ".json")
                or path.relative_to(ws).parts[0] == "src"):
            continue
        text = "\n".join(line.strip() for line in path.read_text(errors="replace").splitlines())
        for name, lines in bodies.items():
            for i in range(len(lines) - 2):
                if "\n".join(lines[i:i + 3]) in text:
                    leaks.append(f"{path.relative_to(ws)}: {name}: {lines[i]}")
                    break
    assert leaks == []
