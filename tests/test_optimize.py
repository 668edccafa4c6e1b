"""The one switch (``EngineConfig.optimize``, phase 9's page): each optimization left unset takes its
``off`` value, or with ``optimize`` its ``on`` value where the device and the other flags allow it;
an explicit value always wins, and the engine logs what is on and why anything is off."""

import argparse
import dataclasses
import logging

import pytest
import torch

from infer.config import EngineConfig, add_engine_args, engine_config_from_args

OPTIMIZATIONS = {f.name: (f.metadata["off"], f.metadata["on"]) for f in dataclasses.fields(EngineConfig)
                 if "off" in f.metadata}
CPU_ONLY_OFF = {"cuda_graphs", "pdl"}  # need a CUDA device


def test_every_optimization_is_unset_until_validate_and_then_off_by_default():
    assert set(OPTIMIZATIONS) >= {"batching", "kv_cache", "chunked_prefill", "prefix_caching", "fused_kernels",
                                  "cuda_graphs", "async_scheduling", "pdl"}
    cfg = EngineConfig(device="cpu")
    assert all(getattr(cfg, name) is None for name in OPTIMIZATIONS)
    cfg.validate()
    assert {name: getattr(cfg, name) for name in OPTIMIZATIONS} == {n: off for n, (off, _) in OPTIMIZATIONS.items()}
    assert cfg.cuda_graph_prefill_max_tokens == 0 and cfg.cuda_graph_mixed_max_tokens == 0
    assert cfg.optimization_notes == {}


def test_optimize_on_a_cpu_turns_on_all_but_the_cuda_ones_and_says_why():
    cfg = EngineConfig(device="cpu", optimize=True).validate()
    for name, (off, on) in OPTIMIZATIONS.items():
        assert getattr(cfg, name) == (off if name in CPU_ONLY_OFF else on), name
    assert cfg.optimization_notes == {"cuda_graphs": "needs a CUDA device", "pdl": "needs a CUDA device"}
    line = cfg.optimization_summary()
    assert line.startswith("optimize: batching=continuous, kv_cache=paged")
    assert "off: cuda_graphs (needs a CUDA device), pdl (needs a CUDA device)" in line
    cfg.validate()  # idempotent: resolving twice changes nothing
    assert cfg.optimization_notes == {"cuda_graphs": "needs a CUDA device", "pdl": "needs a CUDA device"}


def test_an_explicit_value_wins_over_optimize_and_what_it_rules_out_is_named():
    cfg = EngineConfig(device="cpu", optimize=True, kv_cache="contiguous", async_scheduling=False).validate()
    assert cfg.kv_cache == "contiguous" and cfg.async_scheduling is False
    assert cfg.prefix_caching is False  # needs the paged cache
    assert cfg.optimization_notes["prefix_caching"] == "needs kv_cache='paged'"
    assert cfg.optimization_notes["async_scheduling"] == "turned off explicitly"
    assert cfg.batching == "continuous" and cfg.chunked_prefill is True
    # and an explicit "on" without optimize stays what it was, the rest off
    cfg = EngineConfig(device="cpu", kv_cache="paged", prefix_caching=True).validate()
    assert (cfg.batching, cfg.chunked_prefill, cfg.fused_kernels) == ("none", False, False)


def test_the_command_line_has_the_switch_and_the_no_flags_still_win():
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    args = ap.parse_args(["--device", "cpu", "--optimize", "--no-chunked-prefill", "--max-model-len", "256"])
    cfg = engine_config_from_args(args).validate()
    assert cfg.optimize and cfg.chunked_prefill is False and cfg.kv_cache == "paged"
    assert "turned off explicitly" in cfg.optimization_notes["chunked_prefill"]
    help_text = "".join(ap.format_help().split())  # argparse wraps lines where it likes, hyphens too
    assert "False;Truewith--optimize" in help_text and "2048with--cuda-graphs,else0" in help_text
    assert "512with--cuda-graphs,else0" in help_text


def test_graphs_of_prefill_and_mixed_steps_come_with_cuda_graphs_unless_set():
    """Resolved for a CUDA device without needing one: with cuda_graphs given explicitly, the
    prefill and mixed graphs default to 2,048 and 512 tokens (one rank only; tensor parallelism captures
    decode graphs alone), and an explicit 0 keeps them off."""
    cuda = torch.device("cuda")
    cfg = EngineConfig(cuda_graphs=True)
    cfg._resolve_unset(cuda)
    assert (cfg.cuda_graph_prefill_max_tokens, cfg.cuda_graph_mixed_max_tokens) == (2048, 512)
    cfg = EngineConfig(cuda_graphs=True, cuda_graph_prefill_max_tokens=0, cuda_graph_mixed_max_tokens=128)
    cfg._resolve_unset(cuda)
    assert (cfg.cuda_graph_prefill_max_tokens, cfg.cuda_graph_mixed_max_tokens) == (0, 128)
    cfg = EngineConfig(cuda_graphs=True, tensor_parallel_size=2)
    cfg._resolve_unset(cuda)
    assert (cfg.cuda_graph_prefill_max_tokens, cfg.cuda_graph_mixed_max_tokens) == (0, 0)
    cfg = EngineConfig(cuda_graphs=False)
    cfg._resolve_unset(cuda)
    assert (cfg.cuda_graph_prefill_max_tokens, cfg.cuda_graph_mixed_max_tokens) == (0, 0)


def test_an_optimized_engine_gives_the_default_engines_greedy_tokens_and_logs_the_summary():
    from infer import LLM, SamplingParams

    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger, handler = logging.getLogger("infer"), Collect(logging.INFO)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    try:
        fast = LLM("smollm2-135m", device="cpu", dtype="float32", optimize=True, max_model_len=256, progress=False)
        fast_out = [o.outputs[0].token_ids for o in fast.generate(prompts, params)]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    plain = LLM("smollm2-135m", device="cpu", dtype="float32", max_model_len=256, progress=False)
    plain_out = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert fast_out == plain_out
    lines = [r.getMessage() for r in records]
    assert any(line.startswith("optimize: batching=continuous, kv_cache=paged, prefix_caching, chunked_prefill, "
                               "fused_kernels, async_scheduling; off: cuda_graphs") for line in lines), lines


@pytest.mark.parametrize("bad", [{"batching": "fast"}, {"kv_cache": "ring"}])
def test_a_bad_value_beside_optimize_is_still_rejected(bad):
    with pytest.raises(ValueError, match="must be one of"):
        EngineConfig(device="cpu", optimize=True, **bad).validate()
