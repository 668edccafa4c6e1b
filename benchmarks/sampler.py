"""The sampler alone: the plain-PyTorch reference pipeline against the fast paths, per parameter mix.

    python benchmarks/sampler.py                                               # GPU: 1/32/256 rows
    python benchmarks/sampler.py --device cpu --rows 1,8 --vocab 32000 --dtypes float32 --quick

For each batch size (``--rows``), logits dtype (``--dtypes``) and parameter mix, random logits
``[B, V]`` (``V = --vocab``, Qwen3's 151,936 by default; standard normal times 3) are sampled by

* ``reference``: :func:`infer.sampling.sample_reference`, the plain-PyTorch pipeline (the
  sampler as it was before phase 8: every step a full ``[B, V]`` pass, the counter-based RNG
  as ``[B, V]`` int64 tensors, sorts of the full vocabulary);
* ``fast``: :func:`infer.sampling.sample` with the batch's :class:`~infer.sampling.SamplingTensors`
  built by ``from_params`` (Triton kernels on a GPU, the plain-PyTorch fast path on a CPU).

Mixes (every row the same): ``greedy`` (temperature 0), ``temperature`` (0.8), ``top_p``
(temperature 0.8, top-p 0.9), ``top_k`` (top-k 50), ``top_k_top_p`` (temperature 0.7, top-k 20,
top-p 0.8), ``min_p`` (0.05), ``penalties`` (repetition 1.1, presence 0.5, frequency 0.5 over a
512-token prompt and 256 output tokens).

Reported per case: the median time of one ``sample`` call in ms (``triton.testing.do_bench`` on a
GPU, which measures with CUDA events, i.e. device time plus any host gaps between launches; the
median wall time on a CPU), the speed-up, ``agree`` (the share of rows where both chose the same
token for the same seeds: 1.0 expected, see ``infer.sampling.triton_sampler``), ``floor_ms`` (one
read of the logits at the copy bandwidth measured in this run: the least any sampler must
spend), and ``from_params_ms`` (host time to build the batch's tensors, device copy included).
The JSON report (``--out``, default ``benchmarks/runs/sampler.json``) also records the environment and
the ceilings; a Markdown table is written beside it (``.md``).
"""

from __future__ import annotations

import argparse

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
from common import (
    ceilings,
    environment,
    free_device_memory,
    markdown_table,
    out_argument,
    timed,
    write_report,
)

from infer.sampling import SamplingParams, SamplingTensors, sample, sample_reference

MIXES = {
    "greedy": SamplingParams(temperature=0),
    "temperature": SamplingParams(temperature=0.8),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k": SamplingParams(top_k=50),
    "top_k_top_p": SamplingParams(temperature=0.7, top_k=20, top_p=0.8),  # Qwen3's recommended setting
    "min_p": SamplingParams(min_p=0.05),
    "penalties": SamplingParams(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
}


def _time_ms(fn, device: torch.device, repeats: int) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=max(25, repeats * 5), return_mode="median"))
    return timed(fn, device, repeats=repeats, warmup=1) * 1e3


def run_case(rows: int, vocab: int, dtype: torch.dtype, mix: str, device: torch.device, repeats: int,
             bandwidth_gb_s: float | None) -> dict:
    g = torch.Generator(device=device).manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=g, device=device) * 3).to(dtype)
    params = [MIXES[mix]] * rows
    cpu_g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (512,), generator=cpu_g).tolist() for _ in range(rows)]
    outputs = [torch.randint(0, vocab, (256,), generator=cpu_g).tolist() for _ in range(rows)]
    penal = mix == "penalties"

    def build() -> SamplingTensors:
        return SamplingTensors.from_params(
            params, list(range(rows)), [256] * rows, prompts if penal else None, outputs if penal else None,
            None, vocab, device,
        )

    t = build()
    ref = sample_reference(logits, t)
    fast = sample(logits, t)
    agree = float((ref.next_tokens == fast.next_tokens).float().mean())
    ref_ms = _time_ms(lambda: sample_reference(logits, t), device, repeats)
    fast_ms = _time_ms(lambda: sample(logits, t), device, repeats)
    row = {
        "rows": rows, "vocab": vocab, "dtype": str(dtype).removeprefix("torch."), "mix": mix,
        "reference_ms": ref_ms, "fast_ms": fast_ms, "speedup": ref_ms / fast_ms, "agree": agree,
        "from_params_ms": timed(build, device, repeats=repeats, warmup=1) * 1e3, "use_triton": t.use_triton,
    }
    if bandwidth_gb_s:
        row["floor_ms"] = logits.numel() * logits.element_size() / (bandwidth_gb_s * 1e9) * 1e3
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", default="1,32,256", help="comma-separated batch sizes (default 1,32,256)")
    ap.add_argument("--vocab", type=int, default=151_936, help="vocabulary size V (default Qwen3's 151936)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="logits dtypes (default float32,bfloat16)")
    ap.add_argument("--mixes", default=",".join(MIXES), help=f"parameter mixes (default {','.join(MIXES)})")
    ap.add_argument("--repeats", type=int, default=10, help="timing repeats (CPU) / scale of do_bench's window")
    ap.add_argument("--quick", action="store_true", help="smaller ceilings measurement, fewer repeats")
    out_argument(ap, "sampler.json", "JSON report path (a .md table is written beside it)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    mixes = args.mixes.split(",")
    unknown = [m for m in mixes if m not in MIXES]
    if unknown:
        ap.error(f"unknown mixes {unknown}; choose from {list(MIXES)}")
    repeats = 3 if args.quick else args.repeats
    ceil = ceilings(device, quick=True)
    bandwidth = ceil["bandwidth_gb_s"]
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for dtype in dtypes:
            for mix in mixes:
                r = run_case(rows, args.vocab, dtype, mix, device, repeats, bandwidth)
                print(f"rows {rows:4d} {r['dtype']:9s} {mix:12s} reference {r['reference_ms']:8.3f} ms  "
                      f"fast {r['fast_ms']:8.3f} ms  x{r['speedup']:.1f}  agree {r['agree']:.4f}", flush=True)
                results.append(r)
                free_device_memory()
    report = {"benchmark": "sampler", "environment": environment(device), "ceilings": ceil,
              "args": vars(args), "results": results}
    cols = ["rows", "dtype", "mix", "reference_ms", "fast_ms", "speedup", "agree", "floor_ms", "from_params_ms"]
    write_report(report, args.out, markdown_table(results, cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
