"""GPU run 31: the whole batch-1 MLP block in one kernel (fused_mlp.py beside this file) against the two one-row
kernels the engine runs today (norm + gate/up + SiLU, then down + residual), as a chain of L layers' MLPs
(distinct weights, so every byte comes from HBM) captured in one CUDA graph with PDL: what a step pays per
layer, boundaries included. Correctness first (against the plain-PyTorch reference), then a tile sweep,
then the best tile alternated with the two kernels.

usage: python mlp_bench.py [--shapes 4b,0.6b] [--sweep]"""
import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fused_mlp as fm  # noqa: E402  (this run's experiment, not part of the engine)
import torch  # noqa: E402

from infer.kernels import pdl  # noqa: E402
from infer.kernels import skinny_gemm as sg  # noqa: E402

SHAPES = {"4b": (2560, 9728, 36), "0.6b": (1024, 3072, 28), "8b": (4096, 12288, 36)}


def two_kernels(x, nw, gu, d):
    a, _ = sg.skinny_norm_linear(x, None, nw, 1e-6, False, gu, activation="silu")
    return sg.skinny_linear(a, d, residual=x)


def chain_us(layers, x, fn, replays=20, use_pdl=True):
    """Mean us per layer of fn over the chain, CUDA-graph replays."""
    def run():
        y = x
        for nw, gu, d in layers:
            y = fn(y, nw, gu, d)
        return y
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), pdl.scope(use_pdl):
        run()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), pdl.scope(use_pdl):
        out = run()
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
    ap.add_argument("--shapes", default="4b,0.6b")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--transposed", action="store_true", help="also time the fused kernel on column-major down weights")
    ap.add_argument("--components", action="store_true", help="also time each of the two kernels alone")
    ap.add_argument("--configs", default="", help="semicolon-separated tuples to time besides the default")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        h, i, n_layers = SHAPES[name]
        bf = torch.bfloat16
        layers = [((torch.rand(h, device="cuda") + 0.5).to(bf), (torch.randn(2 * i, h, device="cuda") * 0.02).to(bf),
                   (torch.randn(h, i, device="cuda") * 0.02).to(bf)) for _ in range(n_layers)]
        x = torch.randn(1, h, device="cuda", dtype=bf)
        nw, gu, d = layers[0]
        # correctness: one layer against the reference and against the two kernels, PDL off and on
        ref = fm.fused_mlp_reference(x, nw, 1e-6, False, gu, d)
        two = two_kernels(x, nw, gu, d)
        for on in (False, True):
            with pdl.scope(on):
                y = fm.fused_mlp(x, nw, 1e-6, False, gu, d)
                y2 = fm.fused_mlp(x, nw, 1e-6, False, gu, d)
            torch.cuda.synchronize()
            print(f"{name} pdl={on}: max|fused-ref| {(y.float() - ref.float()).abs().max().item():.3g}, "
                  f"differ from ref {(y != ref).sum().item()}/{h}, from two kernels {(y != two).sum().item()}, "
                  f"two kernels vs ref {(two != ref).sum().item()}, repeat identical {torch.equal(y, y2)}", flush=True)
        configs = [fm.default_config(h, i)]
        if args.configs:
            configs += [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
        if args.sweep:
            for bi, bk, bh, bc, w, st in itertools.product((16, 32, 64), (64, 128, 256), (128, 256, 512), (64,),
                                                            (4, 8), (1, 3)):
                thr = 32 * w
                if 2 * bi * bk <= 64 * thr and bh * bi <= 64 * thr and bi * bk >= thr and triton_ok(h, i, bi, bc):
                    configs.append((bi, bk, bh, bc, w, st))
        if args.components:
            gate_up = chain_us(layers, x, lambda y, nw, gu, d: (sg.skinny_norm_linear(
                y, None, nw, 1e-6, False, gu, activation="silu"), y)[1])[0]
            a = torch.randn(1, i, device="cuda", dtype=bf)
            down = chain_us(layers, x, lambda y, nw, gu, d, a=a: sg.skinny_linear(a, d, residual=y))[0]
            print(f"{name} alone, us per layer: norm + gate/up + SiLU {gate_up:.2f}, down + residual {down:.2f}",
                  flush=True)
        results = []
        base, _ = chain_us(layers, x, two_kernels)
        t0 = time.time()
        for c in dict.fromkeys(configs):
            try:
                us, _ = chain_us(layers, x, lambda y, nw, gu, d, c=c: fm.fused_mlp(y, nw, 1e-6, False, gu, d, config=c),
                                 replays=10)
            except Exception as e:  # noqa: BLE001
                print(f"  {c}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            results.append((us, c))
            print(f"  {name} {c}: {us:.2f} us/layer", flush=True)
        results.sort()
        print(f"{name}: two kernels {base:.2f} us/layer; best fused {results[:5]} ({time.time() - t0:.0f} s)", flush=True)
        best = results[0][1]
        fn = lambda y, nw, gu, d, best=best: fm.fused_mlp(y, nw, 1e-6, False, gu, d, config=best)  # noqa: E731
        seq = []
        for _ in range(2):
            seq.append(("two", round(chain_us(layers, x, two_kernels)[0], 2)))
            seq.append(("fused", round(chain_us(layers, x, fn)[0], 2)))
        seq.append(("two, no pdl", round(chain_us(layers, x, two_kernels, use_pdl=False)[0], 2)))
        seq.append(("fused, no pdl", round(chain_us(layers, x, fn, use_pdl=False)[0], 2)))
        if args.transposed:
            layers_t = [(nw, gu, d.t().contiguous().t()) for nw, gu, d in layers]
            for c in configs:
                us = chain_us(layers_t, x, lambda y, nw, gu, d, c=c: fm.fused_mlp(y, nw, 1e-6, False, gu, d, config=c))[0]
                print(f"  {name} {c} down column-major: {us:.2f} us/layer", flush=True)
            yt = fm.fused_mlp(x, nw, 1e-6, False, gu, layers_t[0][2])
            print(f"  {name} column-major down differs from the reference at {(yt != ref).sum().item()}", flush=True)
        gbytes = (3 * h * i * 2) / 1e3
        print(f"{name} A/B us per layer: {seq}; weight bytes per layer {gbytes:.1f} KB", flush=True)


def triton_ok(h, i, bi, bc):
    return -(-h // bc) <= -(-i // bi)


if __name__ == "__main__":
    main()
