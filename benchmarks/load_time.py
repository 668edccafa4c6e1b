"""Cold start: time from nothing to a loaded model ready for a forward, and peak RSS, infer next
to HF transformers loading the same GGUF.

    python benchmarks/load_time.py                          # smollm2-135m, 3 repeats, medians
    python benchmarks/load_time.py --model gemma3-270m --repeats 5 --out benchmarks/runs/load_gemma.json

Every measurement runs in a fresh Python process (imports included, nothing warmed by an
earlier measurement in the same process), on the CPU, in float32:

* ``infer (cold tokenizer cache)``: ``load_model(name, device="cpu")`` with ``INFER_CACHE_DIR``
  an empty directory, so the tokenizer is rebuilt from the GGUF's vocabulary, then one forward
  of 8 tokens.
* ``infer``: the same, run next with that directory now holding the cached tokenizer: what
  every start after the first costs.
* ``HF transformers``: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)``
  + ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` + one forward of 8 tokens.

The child takes ``perf_counter`` at its very first line and prints the time to each stage
(imports, model, tokenizer, forward); the parent also times the whole subprocess from outside
(interpreter start-up and exit included). Peak RSS is the child's
``getrusage(RUSAGE_SELF).ru_maxrss``. The GGUF is read once before the first measurement so
that every run finds it in the OS page cache. Medians over ``--repeats`` (runs interleaved).

Writes the JSON report (commit, hardware, versions, every run and the medians) to ``--out`` (default
``benchmarks/runs/load_time.json``) and the Markdown table beside it (``.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import cpu_model, out_argument, write_report

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is Paris, and the capital of Italy is Rome. The capital of Spain"
N_TOKENS = 8

# Children: the first statement is the clock; the last line printed is a JSON object.
_CHILD_HEAD = """\
import time
_t0 = time.perf_counter()
import json, resource, sys
_marks = {}
def mark(name):
    _marks[name] = time.perf_counter() - _t0
"""

_CHILD_TAIL = """\
mark("ready")
print(json.dumps({"marks": _marks, "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "torch": torch.__version__, "threads": torch.get_num_threads(), "logits_shape": list(shape)}))
"""

INFER_CHILD = _CHILD_HEAD + """\
import torch
from infer.attention import AttentionMetadata, TorchAttentionBackend
from infer.loader import load_model
mark("imports")
lm = load_model(sys.argv[1], device="cpu", progress=False)
mark("model_and_tokenizer")
ids = lm.tokenizer.encode(sys.argv[2])[:{n}]
assert len(ids) == {n}, ids
net = lm.model
net.set_attention_backend(TorchAttentionBackend())
with torch.inference_mode():
    logits = net.compute_logits(net(torch.tensor(ids), torch.arange({n}), AttentionMetadata.for_prefill([{n}], "cpu")))
shape = logits.shape
""".replace("{n}", str(N_TOKENS)) + _CHILD_TAIL

HF_CHILD = _CHILD_HEAD + """\
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
mark("imports")
from pathlib import Path
path = Path(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
mark("model")
tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
mark("model_and_tokenizer")
ids = tok(sys.argv[2])["input_ids"][:{n}]
assert len(ids) == {n}, ids
with torch.inference_mode():
    logits = model(torch.tensor([ids])).logits
shape = logits.shape
""".replace("{n}", str(N_TOKENS)) + _CHILD_TAIL

VARIANTS = {
    "infer_cold_cache": ("infer (cold tokenizer cache)", INFER_CHILD),
    "infer": ("infer", INFER_CHILD),
    "hf": ("HF transformers", HF_CHILD),
}


def run_child(code: str, args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"child failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    return result


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware() -> dict[str, Any]:
    mem_gb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gb = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {"cpu": cpu_model(), "cpu_cores": os.cpu_count(), "memory_gb": mem_gb, "platform": platform.platform()}


def versions() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "gguf", "tokenizers", "infer"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(values):
        return statistics.median(values)

    stages = runs[0]["marks"].keys()
    return {
        "ready_s": med([r["marks"]["ready"] for r in runs]),
        "wall_s": med([r["wall_s"] for r in runs]),
        "stages_s": {k: med([r["marks"][k] for r in runs]) for k in stages},
        "peak_rss_mb": med([r["maxrss_mb"] for r in runs]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "gemma3-270m"],
                   help="shipped model to load (default: smollm2-135m)")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per variant; medians reported")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="what to measure (default: all)")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed to one child process")
    out_argument(p, "load_time.json", "write the report as JSON here (and a Markdown table beside it)")
    args = p.parse_args(argv)

    from infer.loader.registry import shipped_model_path

    path = shipped_model_path(args.model)  # also assembles gemma's chunks once, outside the timings
    with open(path, "rb") as f:  # warm the OS page cache: every variant reads the file from memory
        while f.read(64 << 20):
            pass
    base_env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"}

    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory(prefix="infer-load-time-") as tmp:
        for i in range(args.repeats):
            cache = Path(tmp) / f"cache{i}"  # empty: the cold run fills it, the warm run reads it
            cache.mkdir()
            for variant in args.variants:
                label, code = VARIANTS[variant]
                if variant == "hf":
                    child_args, env = [str(path), PROMPT], base_env
                else:
                    child_args, env = [args.model, PROMPT], {**base_env, "INFER_CACHE_DIR": str(cache)}
                    if variant == "infer" and "infer_cold_cache" not in args.variants and i == 0:
                        run_child(code, child_args, env, args.timeout)  # fill the cache, not measured
                print(f"[{i + 1}/{args.repeats}] {label} ...", end=" ", flush=True, file=sys.stderr)
                r = run_child(code, child_args, env, args.timeout)
                print(f"ready in {r['marks']['ready']:.2f} s, peak RSS {r['maxrss_mb']:.0f} MB",
                      file=sys.stderr)
                runs[variant].append(r)

    summary = {v: summarize(rs) for v, rs in runs.items()}
    speedup = {}
    if "hf" in summary:
        for v in ("infer", "infer_cold_cache"):
            if v in summary:
                speedup[v] = {
                    "ready": summary["hf"]["ready_s"] / summary[v]["ready_s"],
                    "wall": summary["hf"]["wall_s"] / summary[v]["wall_s"],
                    "peak_rss": summary["hf"]["peak_rss_mb"] / summary[v]["peak_rss_mb"],
                }
    first = next(iter(runs.values()))[0]
    report = {
        "benchmark": "load_time",
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "model": args.model,
        "model_file": str(path),
        "model_file_mb": round(path.stat().st_size / 2**20, 1),
        "device": "cpu",
        "dtype": "float32",
        "forward_tokens": N_TOKENS,
        "repeats": args.repeats,
        "hardware": hardware(),
        "versions": versions(),
        "torch_threads": first["threads"],
        "summary": summary,
        "speedup_hf_over_infer": speedup,
        "runs": runs,
    }

    rows = []
    for v, s in summary.items():
        st = s["stages_s"]
        rows.append(
            f"| {VARIANTS[v][0]} | {st['imports']:.2f} | {st['model_and_tokenizer'] - st['imports']:.2f} "
            f"| {st['ready'] - st['model_and_tokenizer']:.3f} | **{s['ready_s']:.2f}** | {s['wall_s']:.2f} "
            f"| {s['peak_rss_mb']:.0f} |"
        )
    table = "\n".join([
        f"Load time, {args.model} ({report['model_file_mb']} MB GGUF), CPU float32, "
        f"median of {args.repeats} fresh process(es); {report['hardware']['cpu']}, "
        f"{report['hardware']['cpu_cores']} cores, torch {report['versions']['torch']}, commit {report['commit'][:12]}",
        "",
        "| variant | imports (s) | load model + tokenizer (s) | forward, 8 tokens (s) | ready (s) "
        "| process wall (s) | peak RSS (MB) |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ])
    for v, s in speedup.items():
        table += (f"\n\nSpeed-up, {VARIANTS[v][0]} vs HF: {s['ready']:.2f}x to ready "
                  f"({s['wall']:.2f}x process wall); HF peak RSS is {s['peak_rss']:.2f}x infer's")
    write_report(report, args.out, table)
    return report


if __name__ == "__main__":
    main()
