"""Run 24: the decode attention kernel at batch 1 (Qwen3-4B heads), as a decode step runs it: 36 launches
back to back in a CUDA graph (one per layer, each its own cache), with PDL, per split plan
(num_splits, min_split_keys). Prints microseconds per launch for each context length."""
import sys

import torch

from infer.attention import triton_ops as to
from infer.kernels import pdl

hq, hkv, d, bs, layers = 32, 8, 128, 16, 36
for ctx in (128, 256, 512, 1024):
    nblk = -(-ctx // bs)
    caches = [(torch.randn(nblk + 4, bs, hkv, d, device="cuda", dtype=torch.bfloat16),
               torch.randn(nblk + 4, bs, hkv, d, device="cuda", dtype=torch.bfloat16)) for _ in range(layers)]
    q = torch.randn(1, hq, d, device="cuda", dtype=torch.bfloat16)
    bt = torch.arange(nblk, device="cuda", dtype=torch.int32)[None]
    bt = torch.cat([bt, torch.zeros(1, 2048 - nblk, device="cuda", dtype=torch.int32)], 1)  # a 32k-wide table
    sl = torch.tensor([ctx], device="cuda", dtype=torch.int32)
    ref = to.paged_decode_attention(q, *caches[0], bt, sl, d ** -0.5, num_splits=1)
    row = [f"ctx {ctx}:"]
    for plan in ((33, 0), (33, 128), (33, 256), (33, 512), (1, 0), (8, 0)):
        out = torch.empty_like(q)
        with pdl.scope():
            to.paged_decode_attention(q, *caches[0], bt, sl, d ** -0.5, out=out, num_splits=plan[0], min_split_keys=plan[1])
            torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for kc, vc in caches:
                    to.paged_decode_attention(q, kc, vc, bt, sl, d ** -0.5, out=out, num_splits=plan[0],
                                              min_split_keys=plan[1])
        g.replay()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        row.append(f"{plan}={s.elapsed_time(e) * 1e3 / 20 / layers:.2f}us")
    print(" ".join(row), flush=True)
sys.exit(0)
