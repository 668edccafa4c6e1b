"""The parity gate's own arithmetic (scripts/gpu_parity.py): the float64 judge and the fused-op swaps.

The gate itself runs on a GPU at real shapes; here its decisions are checked on hand-built logits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import gpu_parity  # noqa: E402


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_float64_agreement_says_which_side_the_exact_answer_takes():
    exact = [_logits([[1.0, 0.999, 0.0], [0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])]
    hf = [_logits([[0.9, 1.0, 0.0], [0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])]  # position 0: HF picks token 1
    mine = [_logits([[1.0, 0.9, 0.0], [0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])]  # 0: token 0 (exact's); 1: token 2
    out = gpu_parity.float64_agreement(exact, {"hf": hf, "infer": mine}, hf, mine)
    assert out["argmax_agree_f64"] == {"hf": pytest.approx(2 / 3), "infer": pytest.approx(2 / 3)}
    m0, m1 = out["mismatches"]
    assert (m0["position"], m0["hf_token"], m0["infer_token"], m0["f64_argmax"]) == (0, 1, 0, 0)
    assert m0["gap_f64"] == pytest.approx(-0.001) and m0["f64_margin"] == pytest.approx(0.001)
    assert (m1["position"], m1["gap_f64"]) == (1, pytest.approx(1.0))
    assert out["mismatches_f64_sides_with_infer"] == 1
    # one bf16 ulp of a logit near 1 is 2^-7: position 0's gap is within it, position 1's is not
    assert out["mismatches_within_one_bf16_ulp"] == 1


def _metrics(agree: float) -> dict:
    return {"infer_logits_finite": True, "top8_mean_abs_dlogprob": 0.01, "top8_p99_abs_dlogprob": 0.05,
            "argmax_agree_tie_aware": agree, "mismatch_ref_gap_max": 0.5}


def test_the_float64_judge_passes_infer_only_when_it_is_as_accurate_as_hf():
    floor = {"argmax_agree_tie_aware": 0.97, "mismatch_ref_gap_max": 0.1}
    bad, _ = gpu_parity.check_gate(_metrics(0.96), "bf16", floor)
    assert len(bad) == 2  # below the floor, and a mismatch beyond the near-tie budget
    as_good = {"argmax_agree_f64": {"hf_sdpa": 0.95, "hf_eager": 0.96, "infer": 0.95}}
    bad, criterion = gpu_parity.check_gate(_metrics(0.96), "bf16", floor, f64=as_good)
    assert bad == [] and "float64" in criterion
    worse = {"argmax_agree_f64": {"hf_sdpa": 0.95, "hf_eager": 0.96, "infer": 0.94}}
    bad, _ = gpu_parity.check_gate(_metrics(0.96), "bf16", floor, f64=worse)
    assert bad and "float64" in bad[-1]
    bad, _ = gpu_parity.check_gate(_metrics(0.96), "bf16", floor, strict_argmax=True, f64=as_good)
    assert bad  # --strict-argmax: no judge


def test_mixed_ops_swaps_only_the_named_ops_for_their_reference_twins():
    from infer.kernels import fused_reference, fused_triton

    ops = gpu_parity.mixed_ops({"act_and_mul"})
    assert ops.act_and_mul is fused_reference.act_and_mul
    assert ops.rms_norm is fused_triton.rms_norm and ops.qk_norm_rope is fused_triton.qk_norm_rope
    assert set(gpu_parity.fused_op_names()) <= set(vars(ops))
    with pytest.raises(ValueError, match="unknown fused op"):
        gpu_parity.mixed_ops({"gelu"})
