"""The exercise mechanism, both ways: the reference solutions pass the grader, and a freshly
stubbed workspace fails exactly the stubbed exercises (and the rest of the package still imports)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from infer.exercises import EXERCISES, REPO, find_regions, grade, prepare, stub


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


LEAF = {0: "rms_norm", 1: "top_p", 2: "abort_request", 3: "batch_ready", 4: "top_k",
        5: "paged_decode_inner_loop", 6: "chunk_schedule"}


def test_every_phase_has_a_leaf_exercise():
    assert set(LEAF) == {e.phase for e in EXERCISES.values()}
    assert all(EXERCISES[name].phase == phase for phase, name in LEAF.items())


@pytest.mark.parametrize("phase", sorted({e.phase for e in EXERCISES.values()}))
def test_grader_both_ways(phase, tmp_path, capsys):
    exercises = [e for e in EXERCISES.values() if e.phase == phase]
    assert all(grade(REPO, exercises, quiet=True).values()), "a reference solution fails its tests"
    # stub one exercise whose code no other exercise's tests run (many exercises sit on the engine's
    # main path, which every engine test crosses): it fails, the others of the phase still pass
    stubbed = EXERCISES[LEAF[phase]]
    ws = tmp_path / "ws"
    prepare(ws, [stubbed])
    check = subprocess.run([sys.executable, "-c", "import infer.llm, infer.exercises"], cwd=ws,
                           env={"PYTHONPATH": str(ws / "src")}, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr  # everything else still imports
    results = grade(ws, exercises, quiet=True)
    assert results == {e.name: e is not stubbed for e in exercises}
    assert f"score: {len(exercises) - 1}/{len(exercises)}" in capsys.readouterr().out
