"""Test configuration shared by every test.

* The tests test the code next to them: ``src/`` of this checkout (or ``$INFER_SRC``, set by
  the exercise grader to a student's workspace) goes first on ``sys.path`` and on the
  ``PYTHONPATH`` of the subprocesses tests start, and the run stops at once if ``infer`` would
  still come from elsewhere (an installed copy would grade the reference, not the student).
* With no CUDA GPU, ``TRITON_INTERPRET=1`` is set *before* any kernel module is imported, so
  Triton kernels run on CPU tensors under the interpreter (docs/contributing.md).
* Tests marked ``gpu`` skip cleanly on a machine without a GPU.
* Real-model fixtures are session-scoped: each model is loaded once per test run.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see src/infer/__init__.py; before torch loads

SRC = Path(os.environ.get("INFER_SRC") or Path(__file__).resolve().parent.parent / "src").resolve()
if str(SRC) not in sys.path[:1]:
    sys.path.insert(0, str(SRC))
if os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] != str(SRC):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
_loaded = sys.modules.get("infer")
_origin = _loaded.__file__ if _loaded is not None else importlib.util.find_spec("infer").origin
if not Path(_origin).resolve().is_relative_to(SRC):
    raise RuntimeError(f"the tests would import infer from {_origin}, not from {SRC}; refusing to run")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# one intra-op thread pool per pytest process: with pytest-xdist's workers (scripts/test.sh) the cores are
# shared between them, not each taken by every worker
torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


_OUTCOMES: dict[str, str] = {}  # node id -> "passed" / "failed" / "skipped", this session's tests so far
_MUTANTS = "tests/test_exercise_mutants.py::test_every_reference_passes_and_every_mutant_fails"
# Under pytest-xdist (scripts/test.sh: --dist loadfile --no-loadscope-reorder) each file is one unit of work,
# handed out in collection order, and a worker takes its next file while the last tests of the current one
# still run. So the longest files go first: a long file handed out last would leave one worker busy for
# minutes while the other idles. Seconds per file, two workers on CI's 2 cores (2026-11-26): the mutant
# grading 240-370 (~230 since it skips the references whose tests are in the run), generation 222,
# batching 195, server 175, structured 123, benchmarks 93, chunked prefill 76, fused kernels 75, parity 62,
# the GGUF tokenizer 50; every other file under 50.
_LONGEST_FIRST = ("test_exercise_mutants.py", "test_generation.py", "test_batching.py", "test_server.py",
                  "test_structured.py", "test_benchmarks.py", "test_chunked_prefill.py", "test_fused_kernels.py",
                  "test_parity.py", "test_gguf_tokenizer.py")


def pytest_runtest_logreport(report):
    """Record each test's outcome (its worst phase: setup, call, teardown) for :func:`session_outcomes`."""
    previous = _OUTCOMES.get(report.nodeid)
    if report.failed:
        _OUTCOMES[report.nodeid] = "failed"
    elif report.skipped and previous != "failed":
        _OUTCOMES[report.nodeid] = "skipped"
    elif report.when == "call" and previous is None:
        _OUTCOMES[report.nodeid] = "passed"


_SCHEDULED: set[str] = set()  # node ids this pytest-xdist session runs (on some worker), once collected


def pytest_collection_finish(session):
    """Under pytest-xdist every worker collects the whole run (the controller hands out indices into it)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _SCHEDULED.update(item.nodeid for item in session.items)


@pytest.fixture(scope="session")
def session_scheduled() -> set[str]:
    """Under pytest-xdist: the node ids of every test of this run, on whichever worker it runs (a failure
    there fails the run). Run in one process: empty (:func:`session_outcomes` tells what passed)."""
    return _SCHEDULED


@pytest.fixture(scope="session")
def session_outcomes() -> dict[str, str]:
    """The outcomes of the tests this session (this process: one pytest-xdist worker's) has run so far,
    by node id (``tests/x.py::test[id]``). Run serially, the mutant grading runs last
    (:func:`pytest_collection_modifyitems`) and grades again only the reference solutions whose tests
    did not all pass here."""
    return _OUTCOMES


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that talked to a server (tests/server_fixture.py) shows the server's last
    traceback: a student's bug in the server shows up there, not in the bare HTTP 500."""
    report = yield
    if report.failed:
        for value in getattr(item, "funcargs", {}).values():
            servers = value.values() if isinstance(value, dict) else [value]
            for srv in servers:
                if hasattr(srv, "stderr") and hasattr(srv, "proc"):
                    err = srv.stderr()
                    at = err.rfind("Traceback (most recent call last)")
                    if at >= 0:
                        lines = err[at:].splitlines()  # the innermost frames and the exception
                        tail = lines[:1] + (["  ..."] if len(lines) > 21 else []) + lines[1:][-20:]
                        report.sections.append((f"server traceback ({srv.url})", "\n".join(tail)))
    return report


def _file_rank(item) -> int:
    name = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
    return _LONGEST_FIRST.index(name) if name in _LONGEST_FIRST else len(_LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    # (sorts are stable: the tests of a file keep their order)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker of pytest-xdist: the longest files first
        items.sort(key=_file_rank)
    else:  # one process: the mutant grading last, to skip the references whose tests have just passed
        items.sort(key=lambda item: item.nodeid == _MUTANTS)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    """The shipped SmolLM2-135M (float32, CPU), loaded once."""
    from infer.loader import load_model

    return load_model("smollm2-135m", device="cpu", dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random-weight Llama checkpoint (scripts/make_synthetic_checkpoint.py), loaded once.

    For engine mechanics (scheduling, batching, aborts) where real weights add only time.
    """
    import sys
    from pathlib import Path

    from infer.loader import load_model

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    path = make_checkpoint("tiny-llama", tmp_path_factory.mktemp("tiny-llama"), dtype="float32", device="cpu")
    return load_model(str(path), device="cpu", dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory):
    """A tiny random-weight Gemma 3 (sliding window 32, head_dim 32), loaded once."""
    import sys
    from pathlib import Path

    from infer.loader import load_model

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    path = make_checkpoint("tiny-gemma3", tmp_path_factory.mktemp("tiny-gemma3"), dtype="float32", device="cpu")
    return load_model(str(path), device="cpu", dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def gemma3():
    """The shipped Gemma 3 270M (float32, CPU), loaded once."""
    from infer.loader import load_model

    return load_model("gemma3-270m", device="cpu", dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2):
    """HF transformers' model from the same SmolLM2 GGUF (the reference), float32; the header parsed once
    by a faster reader of the same bytes (tests.hf_reference.fast_gguf_reader)."""
    from transformers import AutoModelForCausalLM

    from tests.hf_reference import fast_gguf_reader

    with fast_gguf_reader():
        return AutoModelForCausalLM.from_pretrained(
            smollm2.path.parent, gguf_file=smollm2.path.name, dtype=torch.float32
        ).eval()


@pytest.fixture(scope="session")
def hf_gemma3(gemma3):
    """HF transformers' model from the same Gemma 3 GGUF (the reference), float32; the header parsed once
    by a faster reader of the same bytes (tests.hf_reference.fast_gguf_reader)."""
    from transformers import AutoModelForCausalLM

    from tests.hf_reference import fast_gguf_reader

    with fast_gguf_reader():
        return AutoModelForCausalLM.from_pretrained(
            gemma3.path.parent, gguf_file=gemma3.path.name, dtype=torch.float32
        ).eval()
