"""Prepare a student workspace, grade it with the instructor's tests, and grade the mutants.

See :mod:`classroom.exercises` for what an exercise is. Grading runs the tests registered for
each exercise from this repository's ``tests/`` (never the workspace's, which a student can edit)
against the workspace's ``src/``; :func:`grade_mutants` proves the grader by grading every
plausible wrong solution of :mod:`classroom.mutants` (each must FAIL) beside the reference (which
must PASS).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Collection
from pathlib import Path

from classroom.exercises import EXERCISES, MANIFEST, REPO, TESTS, Exercise, ordered, stub


def prepare(out: Path, exercises: list[Exercise], root: Path = REPO) -> None:
    """Copy the repository (the files git tracks or would track: no .git, environments, builds, caches or
    the classroom tooling) to ``out``, stub the exercises and record their names in
    ``out/.infer-exercises.json`` (what :func:`grade` grades by default).

    Raises:
        SystemExit: no exercises, or ``out`` exists and is not empty.
    """
    if not exercises:
        raise SystemExit("no exercises to prepare")
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty")
    files = _repository_files(root)
    if files is None:  # not a git checkout: everything but builds, caches and environments
        ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache", "site",
                                        ".ruff_cache", ".whl", "classroom", MANIFEST)
        shutil.copytree(root, out, ignore=ignore, dirs_exist_ok=True)
    else:
        for rel in files:
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, out / rel)
    for e in exercises:
        path = out / e.file
        path.write_text(stub(path.read_text(), e.name, e.hint))
    (out / MANIFEST).write_text(json.dumps({"exercises": [e.name for e in exercises]}, indent=1) + "\n")
    # no grader and no mutant table in a workspace (they hold reference fragments): `python -m classroom`
    # there only says where grading happens
    (out / "classroom").mkdir()
    (out / "classroom" / "__init__.py").write_text('"""Graded from the course repository, not from here."""\n')
    (out / "classroom" / "__main__.py").write_text(
        "raise SystemExit('this is a workspace made by `python -m classroom prepare`: grade it from the course "
        "repository, with `python -m classroom grade --root ' + __import__('os').getcwd() + '`')\n")
    print(f"prepared {out} with {len(exercises)} exercise(s): {', '.join(e.name for e in exercises)}")


def _repository_files(root: Path) -> list[str] | None:
    """The files a workspace gets: what git tracks in ``root`` and what it would track (untracked, not
    ignored: a student's new file), without the classroom tooling; None when ``root`` is no git checkout.
    Ignored files (virtual environments, builds, benchmark runs, local scratch folders) stay behind."""
    try:
        ls = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return [f for f in dict.fromkeys(ls.stdout.split("\0"))
            if f and not f.startswith("classroom/") and f != MANIFEST and (root / f).is_file()]


def prepared(root: Path) -> list[Exercise] | None:
    """The exercises recorded in workspace ``root`` by :func:`prepare`, or None if it has no record."""
    path = root / MANIFEST
    if not path.exists():
        return None
    names = json.loads(path.read_text())["exercises"]
    unknown = [n for n in names if n not in EXERCISES]
    if unknown:
        raise SystemExit(f"{path} names unknown exercise(s) {unknown}: prepared by another version of infer?")
    return ordered([EXERCISES[n] for n in names])


def grading_env(root: Path) -> dict[str, str]:
    """The environment the tests run in: ``infer`` from ``root/src``, checked before anything runs.

    ``INFER_SRC`` tells ``tests/conftest.py`` which ``src`` to put first (and to verify); the
    subprocesses some tests start (servers) inherit ``PYTHONPATH``.

    Raises:
        SystemExit: the instructor's tests are not beside this package (a copy of ``classroom/``
            outside a checkout), or ``infer`` would be imported from somewhere other than ``root/src``.
    """
    if not (TESTS / "conftest.py").exists():
        raise SystemExit(f"grading runs the instructor's tests, and {TESTS} has none: run the grader from a "
                         "checkout of the repository (python -m classroom at its root)")
    src = (root / "src").resolve()
    env = dict(os.environ, PYTHONPATH=str(src), INFER_SRC=str(src))
    probe = subprocess.run([sys.executable, "-P", "-c", "import importlib.util as u; print(u.find_spec('infer').origin)"],
                           cwd=root, env=env, capture_output=True, text=True)
    origin = probe.stdout.strip()
    if probe.returncode != 0 or not origin or not Path(origin).resolve().is_relative_to(src):
        raise SystemExit(f"refusing to grade: `infer` would be imported from {origin or probe.stderr.strip()!r}, "
                         f"not from the workspace's {src}")
    return env


def run_tests(root: Path, e: Exercise, env: dict[str, str], timeout: float | None = None) -> tuple[bool, str]:
    """Run ``e``'s tests (the instructor's copies) against ``root``'s code: ``(passed, pytest output)``."""
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--tb=short",
           "--rootdir", str(REPO), *(str(REPO / t) for t in e.tests)]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as ex:
        return False, f"timed out after {timeout} s\n{ex.stdout or ''}"
    return proc.returncode == 0, proc.stdout + proc.stderr


def grade(root: Path, exercises: list[Exercise] | None = None, quiet: bool = False) -> dict[str, bool]:
    """Run each exercise's tests against the code under ``root``; print a table and the score.

    ``exercises`` None: those recorded in ``root`` by :func:`prepare` (all of them when ``root``
    is the repository itself, whose solutions must all pass).

    Raises:
        SystemExit: ``root`` is neither a prepared workspace nor the repository and no exercises
            were given, or see :func:`grading_env`.
    """
    root = root.resolve()
    if exercises is None:
        exercises = prepared(root)
        if exercises is None:
            if root != REPO:
                raise SystemExit(f"{root} has no {MANIFEST} (not made by `prepare`): name the exercises to grade "
                                 "with --phase / --exercise")
            exercises = ordered(list(EXERCISES.values()))
    env = grading_env(root)
    results: dict[str, bool] = {}
    for e in exercises:
        ok, out = run_tests(root, e, env)
        results[e.name] = ok
        if not quiet and not ok:
            print(f"--- {e.name}: failing output (last lines) ---")
            print("\n".join(out.splitlines()[-80:]))
    width = max(len(n) for n in results) if results else 8
    print(f"{'exercise'.ljust(width)}  phase  result")
    for e in exercises:
        waits = [n for n in e.needs if results.get(n) is False]
        note = f"  (its tests also run {', '.join(waits)}: make that pass first)" if waits and not results[e.name] else ""
        print(f"{e.name.ljust(width)}  {e.phase:>5}  {'PASS' if results[e.name] else 'FAIL'}{note}")
    print(f"score: {sum(results.values())}/{len(results)}")
    return results


# Grading many workspaces (the mutants) costs mostly Python start-up: importing torch, pytest, its
# plugins and the test modules' libraries. One process imports them once and forks a child per
# grading run; each child puts its workspace's src first and runs pytest. No `infer` module is
# imported before the fork, so every child imports the code of its own workspace (tests/conftest.py
# checks).
_PRELOAD = ("torch", "numpy", "pytest", "httpx", "openai", "triton", "triton.language", "safetensors",
            "tokenizers", "gguf", "jinja2", "tqdm",
            # the tiny_llama / tiny_gemma3 fixtures write their checkpoints with transformers
            "transformers", "transformers.models.llama.modeling_llama", "transformers.models.gemma3.modeling_gemma3")
_FORKSERVER = r"""
import contextlib, gc, json, os, signal, sys
import torch
if not torch.cuda.is_available():  # as tests/conftest.py: Triton decides interpreted or not at import
    os.environ.setdefault("TRITON_INTERPRET", "1")
import pytest
# every pytest session first imports the plugins installed as entry points (hypothesis,
# schemathesis, anyio...), rewriting their asserts: seconds per run. One empty session here (this
# directory has no tests yet) imports them once; each child's session registers the same modules.
with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
    pytest.main(["-q", "-p", "no:cacheprovider", "--noconftest", "--collect-only", os.getcwd()])
for name in PRELOAD:
    try:
        __import__(name)
    except Exception:
        pass
# all that is loaded now outlives every child: out of the garbage collector's reach, a child's
# collections skip it (instead of walking it each time) and leave its pages shared (copy-on-write)
gc.freeze()
spec = json.loads(sys.stdin.read())
queue, running = list(enumerate(spec["jobs"])), {}

def child(job):
    fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])

    def alarm(*_):
        raise TimeoutError("grading timed out after %d s" % spec["timeout"])

    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(int(spec["timeout"]))
    return int(pytest.main(job["args"]))

while queue or running:
    while queue and len(running) < spec["parallel"]:
        i, job = queue.pop(0)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                code = child(job)
            except BaseException as e:
                print("grading run failed:", repr(e))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        running[pid] = i
    pid, status = os.wait()
    print(json.dumps([running.pop(pid), os.waitstatus_to_exitcode(status)]), flush=True)
"""


def run_many(jobs: list[tuple[Path, Exercise]], parallel: int = 2, timeout: float = 600) -> list[tuple[bool, str]]:
    """:func:`run_tests` for each ``(root, exercise)``, ``parallel`` at a time, from one process
    that imports the heavy libraries once and forks per run (plain subprocesses where there is
    no ``fork``). Returns ``(passed, pytest output)`` per job, in order."""
    if not hasattr(os, "fork"):
        return [run_tests(root, e, grading_env(root), timeout) for root, e in jobs]
    logs = Path(tempfile.mkdtemp(prefix="infer-grade-"))
    try:
        spec = {"parallel": max(1, parallel), "timeout": timeout, "jobs": [
            {"env": grading_env(root), "cwd": str(root), "log": str(logs / f"{i}.log"),
             "args": ["-q", "-x", "-p", "no:cacheprovider", "--tb=short", "--rootdir", str(REPO),
                      *(str(REPO / t) for t in e.tests)]}
            for i, (root, e) in enumerate(jobs)]}
        env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
        env.pop("PYTHONPATH", None)
        code = f"PRELOAD = {_PRELOAD!r}\n{_FORKSERVER}"
        proc = subprocess.run([sys.executable, "-P", "-c", code], input=json.dumps(spec), cwd=logs, env=env,
                              capture_output=True, text=True)
        codes = dict(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("["))
        if len(codes) != len(jobs):
            raise RuntimeError(f"the grading process ended early:\n{proc.stderr[-3000:]}")
        return [(codes[i] == 0, (logs / f"{i}.log").read_text(errors="replace")) for i in range(len(jobs))]
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def grade_mutants(exercises: list[Exercise], jobs: int = 2,
                  passed_references: Collection[str] = ()) -> tuple[dict[str, bool], dict[str, bool]]:
    """Grade each exercise's reference and every mutant of it (:mod:`classroom.mutants`).

    Each mutant gets a workspace of its own (a copy of ``src/`` with that one region changed)
    and only its exercise's tests; ``jobs`` runs go at once. Returns ``(reference passed per
    exercise, passed per mutant id)``; a trustworthy grader PASSes every reference and FAILs
    every mutant. Prints both tables.

    ``passed_references``: names of exercises whose tests the caller runs against this repository
    itself (the test suite: run in one process, it grades the mutants after everything else and names
    the exercises whose tests passed; under pytest-xdist, those whose tests are all in the run): their
    references count as passed without a second run.
    """
    from classroom.mutants import MUTANTS, apply_mutant

    mutants = [m for e in exercises for m in MUTANTS.get(e.name, [])]
    tmp = Path(tempfile.mkdtemp(prefix="infer-mutants-"))
    try:
        runs: list[tuple[Path, Exercise]] = []
        for m in mutants:
            ws = tmp / m.id
            shutil.copytree(REPO / "src", ws / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
            path = ws / EXERCISES[m.exercise].file
            path.write_text(apply_mutant(path.read_text(), m))
            runs.append((ws, EXERCISES[m.exercise]))
        graded = [e for e in exercises if e.name not in passed_references]
        todo = [(REPO, e) for e in graded] + runs
        # the slowest first (server tests start two servers), so the workers finish together
        order = sorted(range(len(todo)), key=lambda i: not any("test_server" in t for t in todo[i][1].tests))
        finished = run_many([todo[i] for i in order], parallel=jobs)
        done = [None] * len(todo)
        for i, result in zip(order, finished):
            done[i] = result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ran = {e.name: ok for e, (ok, _) in zip(graded, done)}
    refs = {e.name: ran.get(e.name, True) for e in exercises}
    got = {m.id: ok for m, (ok, _) in zip(mutants, done[len(graded):])}
    for e, (ok, out) in zip(graded, done):
        if not ok:
            print(f"--- reference {e.name} FAILS (last lines) ---\n" + "\n".join(out.splitlines()[-40:]))
    width = max([len(i) for i in got] + [len(n) for n in refs] + [8])
    print(f"{'reference'.ljust(width)}  graded  (must PASS)")
    for name, ok in refs.items():
        how = "" if name in ran else "  (its tests are the caller's: not graded again)"
        print(f"{name.ljust(width)}  {'PASS' if ok else 'FAIL  <-- the reference fails'}{how}")
    print(f"\n{'mutant'.ljust(width)}  graded  (a wrong solution: must FAIL)")
    for m in mutants:
        print(f"{m.id.ljust(width)}  {'PASS  <-- not caught' if got[m.id] else 'FAIL'}  {m.mistake}")
    print(f"references passing: {sum(refs.values())}/{len(refs)}; mutants caught: "
          f"{sum(not ok for ok in got.values())}/{len(got)}")
    return refs, got
