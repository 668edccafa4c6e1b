"""The house rules that keep infer readable, checked on its own source (docs/contributing.md).

* Layers point down and no package has an import cycle: the import-linter contracts in
  ``pyproject.toml`` (``[tool.importlinter]``), run on the ``src/`` these tests belong to.
* ``import infer`` loads neither the HTTP server nor the classroom tooling.
* No module above ~800 lines, no function above ~150 lines except Triton kernels; the model runner's
  ``execute`` and every HTTP route handler fit on one screen.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "infer"
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 150
ONE_SCREEN = 60


def test_layers_point_down_and_no_package_has_an_import_cycle():
    # In a child process: import-linter's CLI calls logging.config.dictConfig, which disables every
    # logger that exists (``infer`` included) for whatever runs after it in this process.
    command = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    run = subprocess.run([sys.executable, "-c", command, "--no-cache"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Contracts: 2 kept, 0 broken." in run.stdout


def test_import_infer_loads_neither_the_server_nor_the_classroom():
    probe = ("import sys, infer\n"
             "print(sorted(m for m in sys.modules if m.startswith(('classroom', 'infer.server', 'fastapi'))))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT / "src")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _is_triton_kernel(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def _length(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_modules_and_functions_stay_readable(path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_MODULE_LINES, f"{path.name} has grown past {MAX_MODULE_LINES} lines: split it"
    long = [f"{fn.name} ({_length(fn)} lines)" for fn in _functions(ast.parse(text))
            if _length(fn) > MAX_FUNCTION_LINES and not _is_triton_kernel(fn)]
    assert not long, f"functions longer than {MAX_FUNCTION_LINES} lines: {long}"


def test_the_step_and_every_route_handler_fit_on_one_screen():
    runner = ast.parse((SRC / "engine" / "model_runner.py").read_text())
    execute = next(fn for fn in _functions(runner) if fn.name == "execute")
    assert _length(execute) <= ONE_SCREEN
    handlers = []
    for path in (SRC / "server").rglob("*.py"):
        for fn in _functions(ast.parse(path.read_text())):
            routes = [d for d in fn.decorator_list if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                      and d.func.attr in ("get", "post", "put", "delete", "api_route")]
            if routes:
                handlers.append((path.name, fn.name, _length(fn)))
    assert handlers, "no route handler found (module-level handlers on an APIRouter)"
    assert [h for h in handlers if h[2] > ONE_SCREEN] == []


def test_the_tracked_tree_stays_small():
    """The repository is read more than it is run: run logs and reports stay out of it (benchmarks/runs/ is
    ignored; benchmarks/results/ keeps what the docs cite), so a clone stays under 8 MB."""
    ls = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if ls.returncode != 0:
        pytest.skip("not a git checkout")
    size = sum((ROOT / f).stat().st_size for f in ls.stdout.split("\0") if f and (ROOT / f).is_file())
    assert size < 8 * 2**20, f"the tracked tree is {size / 2**20:.1f} MB"
