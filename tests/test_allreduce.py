"""The tensor-parallel all-reduce backends (issue 55; phase 14's ``all_reduce_backend``).

On the CPU: which algorithm a message takes (sizes and dtypes worked out by hand from the
thresholds), that ``symm_mem`` falls back to gloo's all-reduce with a log line, and the new fields'
validation. On 2 GPUs (skipped elsewhere): PyTorch symmetric memory's one-shot and two-shot
all-reduce, through :class:`~infer.parallel.allreduce.SymmMemAllReduce`, against NCCL's result on
the same inputs, eager and replayed from a CUDA graph.
"""

from __future__ import annotations

import datetime
import logging
import os

import pytest
import torch
import torch.distributed as dist

from infer.config import EngineConfig
from infer.parallel.allreduce import NCCL, ONE_SHOT, TWO_SHOT, choose_algorithm, make_all_reduce

KB, MB = 1 << 10, 1 << 20


def test_choose_algorithm_by_size_and_dtype():
    one, most = 128 * KB, 8 * MB
    bf16, fp32 = torch.bfloat16, torch.float32
    assert choose_algorithm(2 * 4096, bf16, one, most) == ONE_SHOT  # a [1, 4096] bf16 row: 8 KB
    assert choose_algorithm(one, bf16, one, most) == ONE_SHOT  # the threshold itself is one-shot
    assert choose_algorithm(one + 16, bf16, one, most) == TWO_SHOT
    assert choose_algorithm(most, fp32, one, most) == TWO_SHOT
    assert choose_algorithm(most + 16, fp32, one, most) == NCCL  # larger than the buffer
    assert choose_algorithm(1024, torch.float16, one, most) == NCCL  # no symmetric-memory kernel for fp16
    assert choose_algorithm(6, bf16, one, most) == NCCL  # not a multiple of 16 bytes
    assert choose_algorithm(0, bf16, one, most) == NCCL
    assert choose_algorithm(1024, bf16, 0, most) == TWO_SHOT  # one-shot off
    assert choose_algorithm(1024, bf16, one, 0) == NCCL  # symmetric memory off


def test_symm_mem_on_the_cpu_falls_back_to_gloo_with_a_log_line(caplog):
    with caplog.at_level(logging.WARNING, logger="infer"):
        assert make_all_reduce("symm_mem", None, torch.device("cpu"), MB, KB, rank=0) is None
    assert "all_reduce_backend='symm_mem' needs CUDA" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infer"):  # the other ranks stay quiet
        assert make_all_reduce("symm_mem", None, torch.device("cpu"), MB, KB, rank=1) is None
        assert make_all_reduce("nccl", None, torch.device("cpu"), MB, KB, rank=0) is None
    assert caplog.text == ""


@pytest.mark.parametrize("fields,match", [
    ({"all_reduce_backend": "custom"}, "all_reduce_backend must be one of"),
    ({"symm_mem_max_bytes": -1}, "must be >= 0"),
    ({"all2all_backend": "deepep"}, "all2all_backend must be one of"),
    ({"ep_capacity_factor": 1.5}, "needs all2all_backend='fixed_capacity'"),
    ({"all2all_backend": "fixed_capacity", "ep_capacity_factor": 0.0}, "ep_capacity_factor must be > 0"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2}, "node_rank in 0 .. nnodes - 1"),
    ({"tensor_parallel_size": 3, "nnodes": 2}, "do not split evenly over nnodes=2"),
    ({"nnodes": 2}, "do not split evenly"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "master_port": 70000}, "master_port must be a TCP port"),
])
def test_validate_rejects_bad_collective_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(device="cpu", **fields).validate()


# ---------------------------------------------------------------------------- 2 GPUs


def _gpu_rank(rank: int, port: int) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from infer.parallel.allreduce import SymmMemAllReduce

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        symm = SymmMemAllReduce(dist.group.WORLD, dev, max_bytes=4 * MB, one_shot_max_bytes=64 * KB)
        # every message size a decode step of the tiny and the real models sends, both algorithms
        for dtype in (torch.float32, torch.bfloat16):
            for shape in ((1, 64), (3, 64), (1, 4096), (8, 4096), (64, 4096)):
                torch.manual_seed(rank)
                x = torch.randn(shape, device=dev, dtype=dtype)
                want = x.clone()
                dist.all_reduce(want)
                algo = symm.algorithm(x)
                assert algo in (ONE_SHOT, TWO_SHOT), (shape, dtype, algo)
                got = symm(x)
                if dtype == torch.float32:  # two addends: the same sum in any order, bit for bit
                    assert torch.equal(got, want), (shape, algo)
                else:
                    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
        # captured once, replayed on new inputs
        x = torch.zeros((2, 4096), device=dev, dtype=torch.bfloat16)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            symm(x)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = symm(x)
        for seed in (1, 2):
            torch.manual_seed(10 * seed + rank)
            x.copy_(torch.randn_like(x))
            want = x.clone()
            dist.all_reduce(want)
            graph.replay()
            torch.testing.assert_close(y, want, rtol=1.6e-2, atol=1e-2)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_symm_mem_all_reduce_equals_nccl_on_two_gpus():
    from infer.engine.executor import _free_port

    torch.multiprocessing.spawn(_gpu_rank, args=(_free_port(),), nprocs=2, join=True)
