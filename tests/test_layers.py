"""Layer-level references for phase 0 (these tests grade the rms_norm and apply_rope exercises).

Each layer is compared with an independent formulation computed in float64: RMSNorm from its
definition, RoPE as a rotation of complex numbers (the form of the RoFormer paper), the
Llama 3 frequency scaling against Hugging Face's implementation.
"""

from __future__ import annotations

import math

import pytest
import torch

from infer.config import RopeConfig
from infer.models.layers import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_definition(unit_offset, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 48, generator=g).to(dtype) * 3
    x[0] = x[0] * 1e-3  # rows whose mean square is near eps: where eps's place (inside the root) shows
    w = torch.randn(48, generator=g).to(dtype)
    eps = 1e-5
    x64, w64 = x.double(), w.double()
    ref = x64 / torch.sqrt((x64**2).mean(-1, keepdim=True) + eps) * ((1 + w64) if unit_offset else w64)
    out = rms_norm(x, w, eps, unit_offset)
    assert out.dtype == dtype and out.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_rms_norm_rounds_like_hf():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(64, generator=g).to(torch.bfloat16)
    llama, gemma = LlamaRMSNorm(64, eps=1e-6).to(torch.bfloat16), Gemma3RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        llama.weight.copy_(w)
        gemma.weight.copy_(w)
        assert torch.equal(rms_norm(x, w, 1e-6), llama(x))
        assert torch.equal(rms_norm(x, w, 1e-6, unit_offset=True), gemma(x))


def rope_complex_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as complex multiplication: pair (x[i], x[i + d/2]) is rotated by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    half = d // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    angles = positions.double()[:, None] * freqs[None, :]  # [T, d/2]
    z = torch.complex(x[..., :half].double(), x[..., half:].double())  # [T, H, d/2]
    z = z * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("head_dim", [16, 64, 256])
def test_apply_rope_is_a_rotation(head_dim):
    g = torch.Generator().manual_seed(2)
    t, h, theta = 9, 3, 10000.0
    x = torch.randn(t, h, head_dim, generator=g)
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 511, 512, 4000])
    cos, sin = rope_cos_sin(positions, rope_inv_freq(head_dim, RopeConfig(theta)), torch.float32)
    out = apply_rope(x, cos, sin)
    # float32 angles: at position 4000 the angle itself is only good to ~2.4e-4 rad (its ulp)
    torch.testing.assert_close(out.double(), rope_complex_reference(x, positions, theta), rtol=1e-3, atol=1e-3)
    near = positions < 600
    torch.testing.assert_close(out[near].double(), rope_complex_reference(x[near], positions[near], theta),
                               rtol=1e-4, atol=1e-4)
    # a rotation keeps norms, and position 0 is the identity
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0], x[0])


def test_rope_relative_position_property():
    """q·k after RoPE depends only on the distance between the positions (the point of RoPE)."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 1, 32, generator=g), torch.randn(1, 1, 32, generator=g)
    inv = rope_inv_freq(32, RopeConfig(10000.0))

    def score(pq: int, pk: int) -> float:
        cq, sq = rope_cos_sin(torch.tensor([pq]), inv, torch.float32)
        ck, sk = rope_cos_sin(torch.tensor([pk]), inv, torch.float32)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item()

    assert score(10, 3) == pytest.approx(score(107, 100), rel=1e-4, abs=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-3)


def test_llama3_rope_scaling_matches_hf():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling=scaling)
    ref, scale = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = rope_inv_freq(128, RopeConfig(500000.0, scaling))
    assert scale == 1.0
    torch.testing.assert_close(ours, ref.float())
    # the highest frequencies are untouched, the lowest divided by the factor
    base = rope_inv_freq(128, RopeConfig(500000.0))
    assert ours[0] == base[0] and math.isclose(ours[-1].item(), base[-1].item() / 8, rel_tol=1e-6)
