"""Shared pieces of the benchmark programs (method: docs/contributing.md and docs/benchmarks.md).

* :func:`ceilings`: memory bandwidth (a large copy, bytes read + written) and matmul rate
  (bf16 on GPU, fp32 on CPU, random data), measured in the same run as the benchmark.
* :func:`environment`: commit, hardware, library versions: what every report records.
* :func:`decode_floor_s`: the batch-1 decode floor (bytes one step must read / bandwidth).
* :func:`write_report`: JSON + a Markdown table generated from it.
"""

from __future__ import annotations

import json
import os

if "OMP_WAIT_POLICY" not in os.environ:  # see src/infer/__init__.py; before torch loads
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import platform  # noqa: E402
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int = 5, warmup: int = 1, stat=statistics.median) -> float:
    """``stat`` (the median; ``min`` for the best) of ``repeats`` wall times of ``fn()`` in seconds,
    after ``warmup`` untimed calls (device synchronized around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return stat(times)


def ttft_alone(engine, prompt: list[int]) -> float:
    """Seconds from ``engine.add_request(prompt)`` (greedy, ``max_tokens=1``) until its token is
    on the host, in the output a step returns: the TTFT of a request running alone (the device is
    idle at the start). With async scheduling that step has already launched the next one (a
    decode the request does not need: its token is dropped); the clock stops before waiting for
    it, as a client's would, and the engine is drained afterwards, untimed."""
    from infer.sampling import SamplingParams

    sync(engine.runner.device)
    t = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)).request_id
    elapsed = None
    while elapsed is None and engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.outputs and out.outputs[0].token_ids:
                elapsed = time.perf_counter() - t
    while engine.has_unfinished_requests():
        engine.step()
    sync(engine.runner.device)
    if elapsed is None:
        raise RuntimeError("the request finished without a token")
    return elapsed


def engine_overrides(items: list[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` command-line items (``--engine-args``) as EngineConfig keyword arguments:
    ``true``/``false`` become booleans, integers ints, anything else stays a string."""
    kw: dict[str, Any] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine-args: expected FIELD=VALUE, got {item!r}")
        kw[k] = {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)
    return kw


def ceilings(device: str | torch.device, quick: bool = False) -> dict[str, float]:
    """Measured memory bandwidth (GB/s, read + written) and matmul rate (TFLOP/s)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    nbytes = (2 << 30) if cuda else (256 << 20)
    if quick:
        nbytes //= 4
    bufs = [torch.randn(nbytes // 4, device=device)]
    bufs.append(torch.empty_like(bufs[0]))
    t_copy = timed(lambda: bufs[1].copy_(bufs[0]), device, repeats=10 if cuda else 5, warmup=2)
    bufs.clear()
    n = 8192 if cuda else 2048
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t_mm = timed(lambda: a @ b, device, repeats=10 if cuda else 3, warmup=2)
    return {
        "bandwidth_gb_s": 2 * nbytes / t_copy / 1e9,
        "matmul_tflops": 2 * n**3 / t_mm / 1e12,
        "matmul_dtype": str(dtype).replace("torch.", ""),
    }


def git_commit() -> str:
    """The short commit of the code measured; ``$INFER_COMMIT`` wins (the GPU machine gets a copy of
    the working tree whose ``.git`` may lag behind, so the suite is told the commit)."""
    if os.environ.get("INFER_COMMIT"):
        return os.environ["INFER_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(device: str | torch.device) -> dict[str, Any]:
    device = torch.device(device)
    env = {
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def decode_floor_s(model_config, dtype: torch.dtype, context_len: int, bandwidth_gb_s: float) -> float:
    """Seconds one batch-1 decode step must take at least: bytes read / bandwidth.

    Bytes: every weight once (the embedding table only for its one row, unless it is tied to
    the LM head, which reads it whole) plus the K/V of ``context_len`` cached tokens. For an MoE
    model, only the experts one token is routed to (``num_params(active=True)``): the rest are not
    read at batch 1.
    """
    item = torch.empty((), dtype=dtype).element_size()
    params = model_config.num_params(active=True)
    if not model_config.tie_word_embeddings:
        params -= model_config.vocab_size * model_config.hidden_size  # input embeddings: one row
    kv = model_config.kv_bytes_per_token(dtype) * context_len
    return (params * item + kv) / (bandwidth_gb_s * 1e9)


def write_report(report: dict[str, Any], out: str | Path | None, table: str) -> None:
    """Write ``report`` as JSON (and the Markdown ``table`` beside it) when ``out`` is given."""
    print(table)
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str))
        out.with_suffix(".md").write_text(table + "\n")
        print(f"wrote {out} and {out.with_suffix('.md')}")


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- helpers of the
# throughput programs (offline_throughput.py, ablate.py)


def percentiles_ms(xs: list[float], name: str) -> dict[str, float | None]:
    """``{name_mean_ms, name_p50_ms, name_p90_ms, name_p99_ms}`` of durations given in seconds."""
    keys = ("mean", "p50", "p90", "p99")
    xs = [x for x in xs if x is not None]
    if not xs:
        return {f"{name}_{k}_ms": None for k in keys}
    import numpy as np

    a = 1e3 * np.asarray(xs, dtype=float)
    vals = (a.mean(), *np.percentile(a, [50, 90, 99]))
    return {f"{name}_{k}_ms": float(v) for k, v in zip(keys, vals)}


def free_device_memory() -> None:
    """Collect garbage and give cached CUDA memory back (between engines run in one process)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def capture_calls(fn, n: int):
    """A CUDA graph of ``fn(0) .. fn(n - 1)``, each warmed up (compiled) once on a side stream first;
    replaying it times the calls' GPU work without Python's launch overhead."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for i in range(n):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            fn(i)
    return graph


def save_figure(fig, path: str | Path) -> None:
    """Lay out ``fig``, write it to ``path`` as a PNG (parent folders made), close it, say where."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
