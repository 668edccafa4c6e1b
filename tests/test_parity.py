"""The phase-0 parity gate: infer's teacher-forced logits equal Hugging Face transformers'.

On CPU in float32, at every position of several prompts: max |Δlogit| <= 1e-3 and the same
argmax. Real weights (the shipped GGUFs, which HF loads with ``gguf_file=``) and tiny
random-init Llama / Qwen3 / Gemma 3 models (the same state dict in both).
The bfloat16 GPU gate at real shapes is scripts/gpu_parity.py.
"""

from __future__ import annotations

import pytest
import torch

from infer.loader import load_model
from tests.hf_reference import hf_logits, infer_logits, save_hf, tiny_hf_model

MAX_ABS_LOGIT = 1e-3


def assert_parity(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= MAX_ABS_LOGIT, f"max |Δlogit| = {diff:.2e}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), "argmax differs"


def _prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kind", ["llama", "llama3-scaled", "qwen3", "gemma3"])
def test_tiny_random_models_match_hf(kind, tmp_path):
    ref = tiny_hf_model(kind)
    path = save_hf(ref, tmp_path / kind)
    ours = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    assert ours.config.architecture == {"llama3-scaled": "llama"}.get(kind, kind)
    assert ours.config.num_params() == sum(p.numel() for p in ref.parameters())
    # lengths beyond gemma's window of 8 and beyond llama3's original context of 64
    prompts = _prompts(ref.config.vocab_size, [1, 5, 23, 90])
    for seq, logits in zip(prompts, infer_logits(ours.model, prompts)):
        assert_parity(logits, hf_logits(ref, seq))


def test_sharded_checkpoint_loads_identically(tmp_path):
    ref = tiny_hf_model("qwen3")
    path = save_hf(ref, tmp_path / "sharded", max_shard_size="50KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    ours = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    seq = _prompts(ref.config.vocab_size, [17])[0]
    assert_parity(infer_logits(ours.model, [seq])[0], hf_logits(ref, seq))


TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a dragon who loved tea. " * 3,
]


@pytest.mark.slow
def test_smollm2_matches_hf(smollm2, hf_smollm2):
    tok = smollm2.tokenizer
    prompts = [tok.encode(t) for t in TEXTS] + _prompts(smollm2.config.vocab_size, [200], seed=3)
    for seq, logits in zip(prompts, infer_logits(smollm2.model, prompts)):
        assert_parity(logits, hf_logits(hf_smollm2, seq))


@pytest.mark.slow
def test_gemma3_matches_hf_across_sliding_window(gemma3, hf_gemma3):
    tok = gemma3.tokenizer
    assert gemma3.config.sliding_window == 512
    prompts = [tok.encode(t) for t in TEXTS[:2]]
    prompts.append(tok.encode("A long story about the sea. " * 100)[:600])  # crosses the 512 window
    assert len(prompts[-1]) == 600
    for seq, logits in zip(prompts, infer_logits(gemma3.model, prompts)):
        assert_parity(logits, hf_logits(hf_gemma3, seq))


def test_gemma3_transformers4_config_keeps_local_rope_unscaled():
    """Hub configs written by transformers 4 spell the two bases as rope_theta and
    rope_local_base_freq; the global scaling must not reach the sliding layers."""
    from infer.models.gemma3 import gemma3_config

    raw = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=6, num_attention_heads=2,
               num_key_value_heads=1, head_dim=4, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=512)
    cfg = gemma3_config(raw, "config.json")
    assert cfg.rope.theta == 1_000_000.0 and cfg.rope.rope_type == "linear"
    assert cfg.rope_local.theta == 10_000.0 and cfg.rope_local.rope_type == "default"
    assert cfg.layer_types[5] == "full_attention" and cfg.layer_types[0] == "sliding_attention"
