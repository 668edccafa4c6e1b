"""The pages quote only what exists: every repository path, every test node id, and every code
name in backticks under docs/ is checked against the source tree.

Code names are collected from the repository's own Python files (classes, functions, their
parameters, attributes, dataclass fields, module-level names, module names); a quoted call
``name(a, b)`` must name real parameters of a function ``name``. Names from other projects
(PyTorch, Triton, HF transformers, vLLM, ...) are recognized by their module prefix or listed
in ``FOREIGN``; anything else that looks like code and is unknown fails with the page and line.
"""

from __future__ import annotations

import ast
import os
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PATH = re.compile(r"(?<![\w./-])((?:src/infer|tests|benchmarks|scripts|classroom)/[\w./*-]*[\w*])(::[\w\[\]\-.]+)?")
FILE = re.compile(r"^[\w.-]+\.(py|md|json|toml|sh|jinja|txt|yml|yaml|png|cpp|h)$")
CHECKPOINT = re.compile(r"^[\w.-]+\.(gguf|safetensors)$|^model\.safetensors\.index\.json$")  # a model's files
SPAN = re.compile(r"`([^`\n]+)`")
NAME = re.compile(r"^(?P<dotted>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\((?P<args>[^()]*)\))?$")

# Prefixes of names from other libraries and projects (the first dotted component).
FOREIGN_MODULES = {
    "torch", "F", "tl", "triton", "np", "numpy", "heapq", "time", "os", "sys", "json", "math", "random",
    "vllm", "sglang", "transformers", "nanovllm", "openai", "httpx", "fastapi", "uvicorn", "pytest", "asyncio",
    "prometheus_client", "safetensors", "tokenizers", "gguf", "jinja2", "flash_attn", "libdevice", "cuda",
    "client", "torch_dtype", "itertools", "functools", "collections", "threading", "signal", "subprocess",
    "socket", "re", "zlib", "dataclasses", "typing", "pathlib", "argparse", "statistics", "matplotlib",
    "psutil", "mkdocs", "llama_cpp", "lm_eval", "schemathesis", "outlines_core", "model", "self", "args",
}
# Single names from other projects, file formats and APIs that the pages quote.
FOREIGN = {
    "LlamaRMSNorm", "Gemma3RMSNorm", "LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration", "AutoModelForCausalLM", "AutoTokenizer", "PreTrainedTokenizerFast",
    "GenerationConfig", "DynamicCache", "StaticCache", "PagedAttention", "BlockManager", "BlockPool",
    "KVCacheManager", "EngineCore", "AsyncLLM", "LLMEngine", "SamplingParams", "PreemptionMode",
    "FlashAttention", "FlashInfer", "BaseHTTPMiddleware", "StreamingResponse", "BadRequestError",
    "RadixAttention", "CUDAGraph", "TensorDescriptor", "EventSourceResponse", "LogitsProcessor",
    "ThreadPoolExecutor", "BaseModel", "GGUFReader", "Tensor", "Generator", "NotImplementedError",
    "ValueError", "RuntimeError", "KeyError", "TypeError", "IndexError", "TimeoutError", "SystemExit",
    "AssertionError", "StopIteration", "CancelledError", "OSError", "NaN", "None", "True", "False", "NotImplemented",
    "rotate_half", "repeat_kv", "cu_seqlens_q", "detokenize_incrementally", "check_stop_strings", "TorchDispatchMode",
    "CompileConfig", "json_schema", "ref_count", "can_append", "may_append", "do_spin", "o_s", "query_len_b",
    "tokenizer_backend",  # lm-eval's model argument
    # EngineConfig flags of planned phases (docs/index.md)
    "chunked_prefill", "prefix_caching", "fused_kernels", "cuda_graphs", "kv_offload", "tensor_parallel_size",
    "expert_parallel_size",
    "get_computed_blocks",  # vLLM v1's prefix-cache lookup (phase 7)
    # phase 14: vLLM's / torch.distributed's names
    "ColumnParallelLinear", "PR_SET_PDEATHSIG",
}
# Dotted names of other projects' classes, file formats' metadata keys and API object types.
FOREIGN_DOTTED = ("tokenizer.ggml.", "general.", "llama.", "gemma3.attention.", "rope_freqs.", "chat.completion",
                  "LlamaModel.", "GenerationMixin.", "KVCacheBlock.", "text_completion")
# Files of other projects that the pages name.
FOREIGN_FILES = {"convert_hf_to_gguf.py", "modeling_rope_utils.py", "modeling_gguf_pytorch_utils.py", "quants.py",
                 "bench.py", "tokenizer_config.json", "generation_config.json", "chat_template.jinja", "config.json",
                 "tokenizer.json", "model.safetensors",
                 "synthetic.json"}  # written beside a synthetic checkpoint (scripts/make_synthetic_checkpoint.py)
# Calls that the pages write with another library's arguments.
GENERIC_CALLS = {"to", "decode", "encode", "generate"}


SKIP_DIRS = {".git", ".venv", "site", "build", "dist", ".whl", ".gl", "__pycache__", "node_modules", "site-check"}


def repo_paths() -> list[Path]:
    """Every file of the checkout, without virtual environments, builds and caches (pruned, not
    filtered: a .venv inside the checkout holds tens of thousands of files)."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        found.extend(Path(folder) / f for f in files)
    return found


def source_names() -> tuple[set[str], dict[str, set[str]]]:
    """Every name the repository's Python code defines, and the parameters of each function name."""
    names: set[str] = set()
    params: dict[str, set[str]] = defaultdict(set)
    for path in (p for p in repo_paths() if p.suffix == ".py"):
        names.add(path.stem)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                    if arg is not None:
                        names.add(arg.arg)
                        params[node.name].add(arg.arg)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
                names.update(node.name.split("."))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"\w+", node.value):
                    names.add(node.value)  # dictionary keys, metric and field names
                # names quoted in docstrings (``prefix_offset``): the code's own vocabulary
                names.update(w for span in re.findall(r"``([^`]+)``", node.value) for w in re.findall(r"\w+", span))
    for path in ROOT.glob("scripts/*.sh"):  # the shell scripts' sections and functions
        names.update(re.findall(r"\w+", path.read_text()))
    return names, params


def repo_files() -> set[str]:
    return {p.name for p in repo_paths()}


def looks_like_code(span: str) -> bool:
    """A span worth checking: dotted, called, snake_case or CamelCase; not prose or a value."""
    m = NAME.match(span)
    if not m:
        return False
    dotted = m["dotted"]
    return ("." in dotted or m["args"] is not None or "_" in dotted
            or (any(c.isupper() for c in dotted[1:]) and dotted[0].isupper()))


def problems_in(text: str, names: set[str], params: dict[str, set[str]], files: set[str] = frozenset()) -> list[str]:
    found = []
    for path, node in PATH.findall(text):
        path = path.rstrip(".")
        target = ROOT / path
        if path.split("/")[:2] == ["benchmarks", "runs"]:
            continue  # where benchmark runs write (ignored by git): exists only after a run
        if not target.exists() and not any(ROOT.glob(path)):
            found.append(f"path {path} does not exist")
        elif node and target.is_file():
            test = node[2:].split("[")[0]
            if not re.search(rf"^(async )?def {re.escape(test)}\(", target.read_text(), re.M):
                found.append(f"test {path}{node} does not exist")
    for span in SPAN.findall(text):
        span = span.strip()
        if CHECKPOINT.match(span):
            continue
        if FILE.match(span):
            if span not in files and span not in FOREIGN_FILES:
                found.append(f"file `{span}` is in neither the repository nor the list of other projects' files")
            continue
        if span.startswith(FOREIGN_DOTTED) or not looks_like_code(span):
            continue
        m = NAME.match(span)
        parts = m["dotted"].split(".")
        if parts[0] in FOREIGN_MODULES or parts[0] in FOREIGN or (len(parts) == 1 and parts[0].isupper()):
            continue
        missing = [p for p in parts if p not in names]
        if missing:
            found.append(f"`{span}`: {', '.join(missing)} not found in the source")
            continue
        if m["args"] is not None and parts[-1] in params and parts[-1] not in GENERIC_CALLS:
            for arg in (a.strip() for a in m["args"].split(",")):
                name = arg.split("=")[0].strip().lstrip("*")
                if re.fullmatch(r"[a-z_]\w*", name) and name not in params[parts[-1]]:
                    found.append(f"`{span}`: {parts[-1]} has no parameter {name}")
    return found


def test_every_quoted_path_and_code_name_exists():
    names, params = source_names()
    files = repo_files()
    report = []
    for page in DOCS:
        text = page.read_text()
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks: commands and sketches
        for line in text.splitlines():
            for problem in problems_in(line, names, params, files):
                report.append(f"{page.relative_to(ROOT)}: {problem}: {line.strip()[:100]}")
    assert report == [], "\n".join(report)


def test_the_checker_catches_stale_names():
    """The stale names that once sat in the pages are caught; live ones pass."""
    names, params = source_names()
    assert problems_in("`ContiguousKVCache`", names, params)
    assert problems_in("`AttentionMetadata.cache_rows_cpu`", names, params)
    assert problems_in("`read(layer, row, length)`", names, params)
    assert problems_in("`src/infer/engine/no_such_file.py`", names, params)
    assert problems_in("`tests/test_paged.py::test_no_such_test`", names, params)
    assert not problems_in("`KVCache.read(layer_idx, block_table, length)` in `src/infer/attention/kv_cache.py`",
                           names, params)


# ---------------------------------------------------------------------------------- pages teach

PHASES = sorted((ROOT / "docs" / "phases").glob("[0-9][0-9]-*.md"))
RESULTS = ROOT / "benchmarks" / "results"
MAX_PAGE_LINES = 450
SOURCE_LINK = re.compile(r"\]\((?:\.\./)+src/infer/[\w/]+\.py(?:#[\w-]+)?\)")


def markdown_tables(text: str) -> list[str]:
    """The Markdown tables of ``text`` (runs of lines starting with ``|``, header and rule included),
    code blocks left out."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    found, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            rows.append(line.rstrip())
        else:
            if len(rows) >= 3:
                found.append("\n".join(rows))
            rows = []
    return found


def measured_section(page: Path) -> str:
    """The ``## Measured`` section of a phase page (empty if it has none: a planned phase)."""
    parts = page.read_text().split("\n## Measured", 1)
    return parts[1].split("\n## ", 1)[0] if len(parts) == 2 else ""


def test_markdown_tables_are_found_whole_and_outside_code_blocks():
    text = "a\n| h | i |\n|---|---|\n| 1 | 2 |\nb\n```\n| x | y |\n|---|---|\n| 3 | 4 |\n```\n| c |\n"
    assert markdown_tables(text) == ["| h | i |\n|---|---|\n| 1 | 2 |"]


@pytest.mark.parametrize("page", PHASES, ids=lambda p: p.stem)
def test_phase_pages_are_lessons_not_lab_notebooks(page):
    """At most 450 lines; a page that explains implemented code links to the modules it explains; no run
    history (run numbers, the deleted run folders)."""
    text = page.read_text()
    assert len(text.splitlines()) <= MAX_PAGE_LINES, f"{page.name}: {len(text.splitlines())} lines"
    if measured_section(page):  # an implemented phase
        assert SOURCE_LINK.search(text), f"{page.name} links to no module under src/infer/"
    assert "benchmarks/reports" not in text
    assert not re.search(r"\brun \d+ call \d+\b|\bcall \d+ of run \d+\b", text), "run history belongs in commits"


def test_every_measured_table_is_kept_with_its_provenance():
    """Each table of docs/benchmarks.md and of a phase page's Measured section stands verbatim in a file
    of benchmarks/results/, where its commit, hardware and command are recorded."""
    kept = "\n".join(p.read_text() for p in RESULTS.glob("*.md"))
    quoted = [("docs/benchmarks.md", t) for t in markdown_tables((ROOT / "docs" / "benchmarks.md").read_text())]
    quoted += [(f"docs/phases/{p.name}", t) for p in PHASES for t in markdown_tables(measured_section(p))]
    assert len(quoted) >= 20
    missing = [f"{where}: {t.splitlines()[0][:90]}" for where, t in quoted if t not in kept]
    assert missing == [], "tables not found verbatim in benchmarks/results/:\n" + "\n".join(missing)
    for p in RESULTS.glob("[0-9]*.md"):
        text = p.read_text()
        assert "Commit" in text and "ommand" in text, f"{p.name} records no commit or command"


# ---------------------------------------------------------------------------- docs/index.md cannot go stale

INDEX = ROOT / "docs" / "index.md"


def _rows(text: str, header: str) -> list[list[str]]:
    """The body rows (cells stripped) of the table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_the_index_lists_every_engine_flag_with_its_default_and_phase():
    import dataclasses

    from infer.config import EngineConfig

    rows = _rows(INDEX.read_text(), "| Field (`--flag`)")
    want = []
    for f in dataclasses.fields(EngineConfig):
        d, md = f.default, f.metadata
        show = lambda v: f"`{v!r}`" if isinstance(v, str) else f"`{v}`"  # noqa: E731
        default = (f"{show(md['off'])}, optimize: {show(md['on'])}" if "off" in md
                   else f"{show(md['with_cuda_graphs'])} with cuda_graphs, else `0`" if "with_cuda_graphs" in md
                   else "none" if d is None else show(d))
        want.append([f"`{f.name}`", default, str(f.metadata["phase"])])
    assert [r[:3] for r in rows] == want


def test_the_course_path_covers_every_implemented_phase_with_the_catalogues_exercises():
    from collections import Counter

    from classroom.exercises import EXERCISES

    minutes, count = Counter(), Counter()
    for e in EXERCISES.values():
        minutes[e.phase] += e.minutes
        count[e.phase] += 1
    rows = _rows(INDEX.read_text(), "| Session | Phase |")
    phases = [int(re.match(r"\[(\d+)\.", r[1])[1]) for r in rows]
    implemented = sorted(int(p.name[:2]) for p in PHASES if measured_section(p))
    assert sorted(phases) == implemented and len(set(phases)) == len(phases)
    assert [r[0] for r in rows] == [str(i + 1) for i in range(len(rows))]
    for phase, row in zip(phases, rows):
        assert row[4] == f"{minutes[phase]} min ({count[phase]})", (phase, row[4])


def test_the_index_statuses_follow_the_pages_and_the_module_table_the_package():
    text = INDEX.read_text()
    for row in _rows(text, "| # | Phase |"):
        page = ROOT / "docs" / re.search(r"\]\((phases/[\w.-]+\.md)\)", row[1])[1]
        done = row[-1].startswith("done")
        assert done == bool(measured_section(page)), (page.name, row[-1][:40])
        assert done == (RESULTS / page.name).exists(), f"{page.name}: done, and its measured results?"
    listed = " ".join(r[0] for r in _rows(text, "| Module | What it holds |"))
    for child in sorted((ROOT / "src" / "infer").iterdir()):
        if child.name.startswith("_") or child.suffix not in ("", ".py") or child.name == "py.typed":
            continue
        rel = f"src/infer/{child.name}" + ("/" if child.is_dir() else "")
        assert rel in listed or rel.rstrip("/") in listed, f"docs/index.md's module table misses {rel}"
