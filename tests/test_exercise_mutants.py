"""The exercise grader, both ways: every reference solution PASSes, every mutant (a plausible wrong
solution, classroom/mutants.py) FAILs, each graded in a workspace of its own.

A file of its own: the grading is the suite's longest test (2.5-6 minutes on 2 cores), so that under
pytest-xdist (scripts/test.sh, one file per unit of work) it is handed out on its own, first
(tests/conftest.py)."""

from __future__ import annotations

from classroom.exercises import EXERCISES
from classroom.grading import grade_mutants
from classroom.mutants import _ALL


def passed_here(tests: tuple[str, ...], outcomes: dict[str, str]) -> bool:
    """Did each of these node ids (a parametrized test's name alone stands for all its cases) run in this
    session, and pass?"""
    for t in tests:
        ran = [o for nid, o in outcomes.items() if nid == t or nid.startswith(t + "[")]
        if not ran or any(o != "passed" for o in ran):
            return False
    return True


def scheduled_here(tests: tuple[str, ...], scheduled: set[str]) -> bool:
    """Is each of these node ids (a parametrized test's name alone stands for all its cases) among the
    tests of this run?"""
    return all(any(nid == t or nid.startswith(t + "[") for nid in scheduled) for t in tests)


def test_scheduled_here_needs_every_test_in_the_run():
    scheduled = {"t.py::a", "t.py::b[x]", "t.py::b[y]", "t.py::ab"}
    assert scheduled_here(("t.py::a", "t.py::b", "t.py::b[y]"), scheduled)
    assert not scheduled_here(("t.py::a", "t.py::c"), scheduled)  # c is not in the run
    assert not scheduled_here(("t.py::b[z]",), scheduled) and not scheduled_here(("t.py::",), set())
    assert scheduled_here(("t.py::ab",), scheduled) and not scheduled_here(("t.py::abc",), scheduled)


def test_passed_here_needs_every_case_to_have_run_and_passed():
    outcomes = {"t.py::a": "passed", "t.py::b[x]": "passed", "t.py::b[y]": "passed", "t.py::c[x]": "passed",
                "t.py::c[y]": "failed", "t.py::d": "skipped", "t.py::ab": "failed"}
    assert passed_here(("t.py::a", "t.py::b", "t.py::b[x]"), outcomes)
    assert not passed_here(("t.py::a", "t.py::c"), outcomes)  # one case failed
    assert passed_here(("t.py::c[x]",), outcomes)
    assert not passed_here(("t.py::d",), outcomes)  # skipped is not passed
    assert not passed_here(("t.py::e",), outcomes)  # never ran
    assert passed_here(("t.py::a",), {**outcomes, "t.py::a": "passed"}) and not passed_here(("t.py::ab",), outcomes)


def test_every_reference_passes_and_every_mutant_fails(session_outcomes, session_scheduled):
    """The reference solutions (the repository) and the wrong solutions, each in a workspace of
    its own, graded by their exercise's tests. A reference is the repository's own code, so its grading
    is those tests run against it; it is not graded a second time where this run already does that:
    run serially, this test runs last (tests/conftest.py) and skips the references whose tests all
    passed earlier in this session; under pytest-xdist (the README's command, CI) it runs first and
    skips those whose tests are all in the run, on whichever worker (any failure there fails the run).
    The grading of the references alone took ~130 s of CI's 2 cores."""
    proven = {e.name for e in EXERCISES.values()
              if passed_here(e.tests, session_outcomes) or scheduled_here(e.tests, session_scheduled)}
    refs, results = grade_mutants(list(EXERCISES.values()), jobs=2, passed_references=proven)
    assert [name for name, passed in refs.items() if not passed] == [], "these reference solutions FAIL"
    assert [mid for mid, passed in results.items() if passed] == [], "these wrong solutions PASS their grading"
    assert len(results) == len(_ALL)
