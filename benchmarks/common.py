"""Shared pieces of the benchmark programs (method: docs/contributing.md and docs/benchmarks.md).

Every program imports this module before torch (it sets the OpenMP spin below, which libgomp reads
once) and imports nothing from another program: what two programs share lives here or, for the
requests they send, in workloads.py.

* :data:`RUNS`, :func:`out_argument`: where a run writes unless ``--out`` says otherwise,
  ``benchmarks/runs/`` (ignored by git).
* :func:`ceilings`: memory bandwidth (a large copy, bytes read + written) and matmul rate
  (bf16 on GPU, fp32 on CPU, random data), measured in the same run as the benchmark.
* :func:`environment`: commit, hardware, library versions: what every report records.
* :func:`decode_floor_s`: the batch-1 decode floor (bytes one step must read / bandwidth).
* :func:`write_report`: JSON + a Markdown table generated from it.
* :func:`parse_overrides`, :func:`parse_infer_configs`, :func:`infer_label`: EngineConfig overrides
  written on a command line (``--infer-configs "batching=none;batching=continuous"``).
* :func:`model_info`, :func:`make_llm`, :func:`load_hf`: a model's facts without its weights, an
  infer ``LLM`` and the HF transformers peer on the same weights.
* :func:`plot_throughput`, :func:`save_figure`: figures.
"""

from __future__ import annotations

import http.client
import json
import os

if "OMP_WAIT_POLICY" not in os.environ:  # see src/infer/__init__.py; before torch loads
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import platform  # noqa: E402
import socket
import statistics
import subprocess
import time
import typing
from pathlib import Path
from typing import Any

import torch

#: Where a run writes (reports, logs, plots) unless ``--out`` says otherwise; ignored by git. Results
#: the docs cite are kept as small summaries under ``benchmarks/results/``.
RUNS = Path(__file__).resolve().parent / "runs"


def out_argument(parser, name: str, what: str) -> None:
    """Add ``--out`` to ``parser`` (or an argument group), by default ``benchmarks/runs/NAME``
    (``name=""``: the folder itself, for programs whose ``--out`` is a directory)."""
    parser.add_argument("--out", default=str(RUNS / name), help=f"{what} (default: benchmarks/runs/{name})")


def resolve_device(name: str) -> torch.device:
    """``auto``: the GPU when there is one, else the CPU; any other name as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on (for a server or a process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def bench(fn, device: torch.device, cpu_repeats: int = 1, cpu_warmup: int = 0) -> float:
    """Median seconds of ``fn()``: ``triton.testing.do_bench`` on a GPU (warm-up, L2 cleared per run),
    :func:`timed` with ``cpu_repeats`` calls after ``cpu_warmup`` on the CPU."""
    if torch.device(device).type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    return timed(fn, device, repeats=cpu_repeats, warmup=cpu_warmup)


def bench_graphed(fn, device: torch.device, cpu_repeats: int = 1, cpu_warmup: int = 0) -> float:
    """Median seconds of ``fn()`` replayed from a CUDA graph on a GPU (``triton.testing.do_bench_cudagraph``):
    the device's time without the host's launch cost, as the engine's decode steps replay them. A
    microsecond kernel timed by :func:`timed` measures its launch (~20-150 us of Python and driver work);
    :func:`timed` with ``cpu_repeats`` calls after ``cpu_warmup`` on the CPU."""
    if torch.device(device).type == "cuda":
        import triton.testing

        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") / 1e3
    return timed(fn, device, repeats=cpu_repeats, warmup=cpu_warmup)


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
    """``FIELD=VALUE`` command-line items (``--engine-args``) as EngineConfig keyword arguments, each
    value of its field's type (:func:`parse_overrides`)."""
    try:
        return parse_overrides(",".join(items))
    except ValueError as e:
        raise SystemExit(f"--engine-args: {e}") from None


def server_flags(overrides: dict[str, Any]) -> list[str]:
    """CLI flags of ``python -m infer.server`` for EngineConfig overrides (None = leave the default)."""
    out: list[str] = []
    for k, v in overrides.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + k.replace("_", "-"))
        elif v is not None:
            out += [flag, format_value(v)]
    return out


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


def decode_floor_s(model_config, dtype: torch.dtype, context_len: int, bandwidth_gb_s: float,
                   ssm_dtype: torch.dtype = torch.float32) -> float:
    """Seconds one batch-1 decode step must take at least: bytes read / bandwidth.

    Bytes: every weight once (the embedding table only for its one row, unless it is tied to
    the LM head, which reads it whole) plus the K/V of ``context_len`` cached tokens (and a hybrid
    model's recurrent state, read and written once: phase 17). For an MoE
    model, only the experts one token is routed to (``num_params(active=True)``): the rest are not
    read at batch 1.
    """
    item = torch.empty((), dtype=dtype).element_size()
    params = model_config.num_params(active=True)
    if not model_config.tie_word_embeddings:
        params -= model_config.vocab_size * model_config.hidden_size  # input embeddings: one row
    kv = model_config.kv_bytes_per_token(dtype) * context_len
    state = 2 * model_config.state_bytes_per_seq(dtype, ssm_dtype)  # a hybrid's recurrent state: read and written
    return (params * item + kv + state) / (bandwidth_gb_s * 1e9)


def write_report(report: dict[str, Any], out: str | Path | None, table: str) -> None:
    """Write ``report`` as JSON (and the Markdown ``table`` beside it) when ``out`` is given."""
    print(table)
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str))
        out.with_suffix(".md").write_text(table + "\n")
        print(f"wrote {out} and {out.with_suffix('.md')}")


def print_row(row: dict[str, Any]) -> None:
    """One result row on stdout as it lands (floats to 3 decimals): a run cut short keeps what it printed."""
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


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


# ---------------------------------------------------------------------------------- EngineConfig overrides


def _field_base_type(name: str) -> tuple[type, bool]:
    from infer.config import EngineConfig

    kind = typing.get_type_hints(EngineConfig)[name]
    args = typing.get_args(kind)
    optional = type(None) in args
    base = next((t for t in args if t is not type(None)), kind) if args else kind
    return base, optional


def parse_value(name: str, text: str) -> Any:
    """A ``field=value`` string value as the EngineConfig field's type."""
    base, optional = _field_base_type(name)
    low = text.strip().lower()
    if base is str:
        return text.strip()
    if optional and low in ("none", "null"):
        return None
    if base is dict:  # a JSON object (speculative_config)
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError(f"{name}: {text!r} is not a JSON object")
        return value
    if base is bool:
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: {text!r} is not a boolean")
    return base(text)


def parse_overrides(spec: str) -> dict[str, Any]:
    """``"batching=continuous,max_num_seqs=16"`` -> ``{"batching": "continuous", "max_num_seqs": 16}``."""
    from infer.config import EngineConfig

    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in _split_top_level(spec))):
        if "=" not in item:
            raise ValueError(f"{item!r}: expected field=value")
        k, v = (x.strip() for x in item.split("=", 1))
        k = k.replace("-", "_")
        if k not in EngineConfig.field_names():
            raise ValueError(f"{k!r} is not an EngineConfig field ({', '.join(EngineConfig.field_names())})")
        out[k] = parse_value(k, v)
    return out


def _split_top_level(spec: str) -> list[str]:
    """``spec`` split at the commas outside JSON braces, brackets and strings (a JSON value's own commas stay)."""
    items, depth, start, quoted = [], 0, 0, False
    for i, ch in enumerate(spec):
        if ch == '"' and (i == 0 or spec[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and ch in "{[":
            depth += 1
        elif not quoted and ch in "}]":
            depth -= 1
        elif not quoted and depth == 0 and ch == ",":
            items.append(spec[start:i])
            start = i + 1
    return items + [spec[start:]]


def format_value(v: Any) -> str:
    """A value as :func:`parse_value` reads it back (``true``/``false``, ``none``, JSON for a dict)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return json.dumps(v, separators=(",", ":"))
    return "none" if v is None else str(v)


def format_overrides(overrides: dict[str, Any]) -> str:
    """The inverse of :func:`parse_overrides`."""
    return ",".join(f"{k}={format_value(v)}" for k, v in overrides.items())


def parse_infer_configs(spec: str | None) -> list[dict[str, Any]]:
    """``--infer-configs``: ``;``-separated :func:`parse_overrides` items, one infer run each (none: one run, ``{}``)."""
    if not spec:
        return [{}]
    return [parse_overrides(item) for item in spec.split(";") if item.strip()] or [{}]


def infer_label(overrides: dict[str, Any]) -> str:
    """The name of an infer run in tables and reports: ``infer[batching=continuous,...]``."""
    return f"infer[{format_overrides(overrides)}]" if overrides else "infer"


# ---------------------------------------------------------------------------------- models


def model_info(spec: str):
    """``(path, ModelConfig)`` of a short name / .gguf / HF directory, without loading weights."""
    from infer.loader import resolve_model

    path = resolve_model(spec)
    if path.is_dir():
        from infer.loader import hf

        cfg, _ = hf.model_config_from_dir(path)
    else:
        from infer.loader import gguf as g

        reader = g.open_gguf(path)
        cfg = g.model_config_from_gguf(g.read_metadata(reader), {t.name for t in reader.tensors}, path)
        del reader
    return path, cfg


def make_llm(model: str, engine_kwargs: dict[str, Any], max_model_len: int, progress: bool):
    """An infer ``LLM`` of ``model`` with EngineConfig ``engine_kwargs``; ``max_model_len`` where they
    leave it None (a workload's longest prompt + output: the KV cache sized for the workload)."""
    from infer import LLM

    kw = dict(engine_kwargs)
    kw.pop("model", None)
    if kw.get("max_model_len") is None:
        kw["max_model_len"] = max_model_len
    return LLM(model, progress=progress, **kw)


def load_hf(path: Path, device: str, dtype: torch.dtype):
    """HF transformers' model of the same weights (an HF directory, or a .gguf beside its config), eval mode."""
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        m = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return m.to(device).eval()


# ---------------------------------------------------------------------------------- figures


def save_figure(fig, path: str | Path) -> None:
    """Lay out ``fig``, write it to ``path`` as a PNG (parent folders made), close it, say where."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def plot_throughput(rows: list[dict[str, Any]], path: str | Path, title: str) -> None:
    """Bar chart: output tok/s (and total tok/s, lighter) per engine/config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    # "infer[batching=continuous,kv_cache=paged]" as one line per flag, so neighbours never overlap
    labels = [r["label"].replace("[", "\n").replace(",", "\n").rstrip("]") for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows) + 2), 4.5))
    out = [r["output_tok_per_s"] for r in rows]
    tot = [r["total_tok_per_s"] for r in rows]
    bars = ax.bar(x - 0.2, out, 0.4, label="output tok/s")
    ax.bar(x + 0.2, tot, 0.4, label="total tok/s (prompt + output)", alpha=0.45)
    for b, v in zip(bars, out):
        ax.annotate(f"{v:,.0f}" if v >= 100 else f"{v:.3g}", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    save_figure(fig, path)


def stream_http(conn: http.client.HTTPConnection, prompt: list[int], n: int) -> tuple[float, float]:
    """TTFT and TPOT of one streamed request over ``conn``, a kept-alive connection of the standard
    library's ``http.client`` (the lean client: the time between its send and its first chunk is the
    server's and the socket's, with little of its own; see ``server_latency.stream_httpx``)."""
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    for attempt in (0, 1):
        start = time.perf_counter()
        try:
            conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
            r = conn.getresponse()
            break
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            # the server closed the kept-alive connection while it sat idle (uvicorn does after 5 s; the
            # offline run between two requests can be longer on a slow machine) before reading the request:
            # connect again, outside the timing, and send it once more
            if attempt:
                raise
            conn.close()
            conn.connect()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:500]!r}")
    first, count = None, 0
    for line in iter(r.readline, b""):  # http.client undoes the chunked transfer encoding
        if not line.startswith(b"data: {"):
            continue
        if json.loads(line[6:])["choices"]:
            if first is None:
                first = time.perf_counter()
            count += 1
    end = time.perf_counter()
    return first - start, (end - first) / max(count - 1, 1)
