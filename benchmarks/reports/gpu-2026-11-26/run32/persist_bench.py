"""GPU run 32: the persistent-grid skinny GEMM (persistent.py beside this file) against the engine's one-row
kernels, inside a chain of Qwen3-4B layers' four projections (norm + QKV, o + residual, norm + gate/up + SiLU,
down + residual; distinct weights per layer, so every byte comes from HBM; no attention) captured in one CUDA
graph with PDL: what a step pays per layer, boundaries included.

1. correctness at the real shapes: each projection, persistent against the engine's kernel (bit-identical where
   both keep one tile ahead in registers) and against the plain-PyTorch reference;
2. a sweep: one projection at a time persistent (the others the engine's), programs = SMs x c, both K loops;
3. the best of each combined, alternated with the engine's kernels (call 3: the nested loop too, and ptxas'
   registers per thread).

usage: python persist_bench.py [--layers 36] [--mults 1,2,3,4,6,8,12,16]"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import persistent as ps  # noqa: E402  (this run's experiment, not part of the engine)
import torch  # noqa: E402

from infer.kernels import pdl  # noqa: E402
from infer.kernels import skinny_gemm as sg  # noqa: E402

H, HQ, HKV, D, I = 2560, 32, 8, 128, 9728  # Qwen3-4B
PROJS = ("qkv", "o", "gu", "down")


def engine(p, y, lw, a_in):
    """The engine's kernel for projection p: (output, the residual stream after it)."""
    if p == "qkv":
        return sg.skinny_norm_linear(y, None, lw["n1"], 1e-6, False, lw["qkv"])[0], y
    if p == "o":
        out = sg.skinny_linear(a_in, lw["o"], residual=y)
        return out, out
    if p == "gu":
        return sg.skinny_norm_linear(y, None, lw["n2"], 1e-6, False, lw["gu"], activation="silu")[0], y
    out = sg.skinny_linear(a_in, lw["down"], residual=y)
    return out, out


INFO = {}  # (projection, stages, nested) -> ptxas registers and spills


def persistent(p, y, lw, a_in, programs, stages, nested=False):
    kw = dict(nested=nested, info=INFO.setdefault((p, stages, nested), {}))
    if p == "qkv":
        cfg = sg.default_config(1, lw["qkv"].shape[0], H, norm=True)[:3] + (stages,)
        return ps.persistent_linear(y, lw["qkv"], programs, cfg, norm_weight=lw["n1"], **kw)[0], y
    if p == "o":
        cfg = sg.default_config(1, H, HQ * D)[:3] + (stages,)
        out = ps.persistent_linear(a_in, lw["o"], programs, cfg, add=y, **kw)[0]
        return out, out
    if p == "gu":
        cfg = sg.default_config(1, I, H, act=True, norm=True)[:3] + (stages,)
        return ps.persistent_linear(y, lw["gu"], programs, cfg, norm_weight=lw["n2"], activation="silu", **kw)[0], y
    cfg = sg.default_config(1, H, I)[:3] + (stages,)
    out = ps.persistent_linear(a_in, lw["down"], programs, cfg, add=y, **kw)[0]
    return out, out


def layer(y, lw, choice):
    """One layer's projections; choice: projection -> None (engine) or (programs, stages, nested)."""
    def run(p, y, a_in):
        c = choice.get(p)
        return engine(p, y, lw, a_in) if c is None else persistent(p, y, lw, a_in, *c)
    qkv, y = run("qkv", y, None)
    _, y = run("o", y, qkv[:, :HQ * D])  # the attention's output stands in: q's values
    act, y = run("gu", y, None)
    _, y = run("down", y, act)
    return y


def chain_us(layers, x, choice, replays=20):
    def go():
        y = x
        for lw in layers:
            y = layer(y, lw, choice)
        return y
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), pdl.scope(True):
        go()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), pdl.scope(True):
        out = go()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(replays):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / (replays * len(layers)), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--mults", default="1,2,3,4,6,8,12,16")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), f"{sms} SMs", flush=True)
    torch.manual_seed(0)
    bf = torch.bfloat16

    def w(n, k):
        return (torch.randn(n, k, device="cuda") * 0.02).to(bf)

    layers = [{"n1": (torch.rand(H, device="cuda") + 0.5).to(bf), "n2": (torch.rand(H, device="cuda") + 0.5).to(bf),
               "qkv": w((HQ + 2 * HKV) * D, H), "o": w(H, HQ * D), "gu": w(2 * I, H), "down": w(H, I)}
              for _ in range(args.layers)]
    x = torch.randn(1, H, device="cuda", dtype=bf)
    lw = layers[0]
    a_o, a_d = torch.randn(1, HQ * D, device="cuda", dtype=bf), torch.randn(1, I, device="cuda", dtype=bf)
    refs = {"qkv": sg.skinny_norm_linear_reference(x, None, lw["n1"], 1e-6, False, lw["qkv"], None, None)[0],
            "o": (sg.skinny_linear_reference(a_o, lw["o"]).float() + x.float()),
            "gu": sg.skinny_norm_linear_reference(x, None, lw["n2"], 1e-6, False, lw["gu"], None, "silu")[0],
            "down": (sg.skinny_linear_reference(a_d, lw["down"]).float() + x.float())}
    ins = {"qkv": None, "o": a_o, "gu": None, "down": a_d}
    for p in PROJS:
        with pdl.scope(True):
            e = engine(p, x, lw, ins[p])[0]
            for stages, nested, programs in [(s_, n_, p_) for s_ in (0, 3) for n_ in (False, True)
                                             for p_ in (sms, 4 * sms)]:
                    y = persistent(p, x, lw, ins[p], programs, stages, nested)[0]
                    torch.cuda.synchronize()
                    r = refs[p].float()
                    print(f"{p} stages {stages} nested {nested} programs {programs}: differ from engine {(y != e).sum().item()}/"
                          f"{y.numel()}, max|y-ref|/max|ref| {((y.float() - r).abs().max() / r.abs().max()).item():.2e}"
                          f" (engine {((e.float() - r).abs().max() / r.abs().max()).item():.2e})", flush=True)
    base = chain_us(layers, x, {})[0]
    print(f"engine kernels: {base:.2f} us/layer", flush=True)
    best = {}
    for p in PROJS:
        res = []
        for stages in (0, 3):
            for nested in (False, True):
                for c in (int(v) for v in args.mults.split(",")):
                    us = chain_us(layers, x, {p: (c * sms, stages, nested)})[0]
                    res.append((us, c * sms, stages, nested))
        res.sort()
        print(f"{p} persistent (us/layer, programs, stages, nested), best 8: "
              f"{[(round(u, 2), *rest) for u, *rest in res[:8]]}; "
              f"engine {chain_us(layers, x, {})[0]:.2f}", flush=True)
        if res[0][0] < base:
            best[p] = res[0][1:]
    print(f"combined: {best}", flush=True)
    print("ptxas registers/spills per (projection, stages, nested):", {k: v for k, v in INFO.items() if v}, flush=True)
    seq = []
    for _ in range(3):
        seq.append(("engine", round(chain_us(layers, x, {})[0], 2)))
        seq.append(("persistent", round(chain_us(layers, x, best)[0], 2)))
    print(f"A/B us per layer: {seq}", flush=True)
    if best:
        out_e, out_p = chain_us(layers, x, {})[1], chain_us(layers, x, best)[1]
        print(f"36-layer chain output identical: {torch.equal(out_e, out_p)}", flush=True)


if __name__ == "__main__":
    main()
