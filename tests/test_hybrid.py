"""Phase 17: hybrid linear attention (Qwen3.5: Gated DeltaNet + gated attention) and its state cache.

References: Hugging Face transformers' ``qwen3_5`` modeling (its plain-PyTorch gated delta rule and
causal conv1d, and the whole model's logits and ``generate``) on the same tiny random checkpoint
(scripts/make_synthetic_checkpoint.py ``tiny-qwen3.5``: 3 Gated DeltaNet layers, 1 gated-attention
layer), and the recurrent form of the rule against the chunked one.
"""

from __future__ import annotations

import pytest
import torch

from infer.kernels import gated_delta_reference as gdr
from infer.kernels.triton_common import INTERPRET

#: CPU tensors through the Triton kernels: only under the interpreter (tests/conftest.py sets it where there is no
#: GPU); on a GPU machine their twins at real shapes run in tests/test_gpu_phases.py
interpreted = pytest.mark.skipif(not INTERPRET, reason="CPU tensors through Triton kernels need TRITON_INTERPRET=1")

# ---------------------------------------------------------------------------------- the kernels


def _rule_inputs(t: int, h: int, dk: int, dv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = gdr.l2norm(torch.randn(t, h, dk, generator=g))
    k = gdr.l2norm(torch.randn(t, h, dk, generator=g))
    v = torch.randn(t, h, dv, generator=g)
    decay = -torch.rand(t, h, generator=g) * torch.tensor([0.01, 0.3, 3.0])[:h]  # slow to fast forgetting
    beta = torch.rand(t, h, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g)
    return q, k, v, decay, beta, s0


def test_recurrent_and_chunked_forms_agree():
    """The chunked (prefill) and recurrent (decode) forms give the same outputs and final state, from a
    nonzero initial state, over a length that is not a multiple of the chunk; two chunked calls one after
    the other (the state carried between them, as chunked prefill does) equal one call."""
    q, k, v, g, beta, s0 = _rule_inputs(150, 3, 16, 8, seed=0)
    o_rec, s_rec = gdr.recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o_chk, s_chk = gdr.chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=32)
    torch.testing.assert_close(o_chk, o_rec, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s_chk, s_rec, atol=2e-5, rtol=1e-5)
    o1, s1 = gdr.chunk_gated_delta_rule(q[:70], k[:70], v[:70], g[:70], beta[:70], s0, chunk_size=32)
    o2, s2 = gdr.chunk_gated_delta_rule(q[70:], k[70:], v[70:], g[70:], beta[70:], s1, chunk_size=32)
    torch.testing.assert_close(torch.cat([o1, o2]), o_rec, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s2, s_rec, atol=2e-5, rtol=1e-5)


def test_chunked_form_returns_the_states_at_chunk_ends():
    """``states_out``: the states after 0, 64 and 128 of 150 tokens from one chunked pass (prefix caching's
    snapshots) equal the recurrent form's after as many tokens; a count off the chunks is refused."""
    q, k, v, g, beta, s0 = _rule_inputs(150, 3, 16, 8, seed=4)
    states = {0: None, 64: None, 128: None}
    _, last = gdr.chunk_gated_delta_rule(q, k, v, g, beta, s0, states_out=states)
    for n in (64, 128):
        _, want = gdr.recurrent_gated_delta_rule(q[:n], k[:n], v[:n], g[:n], beta[:n], s0)
        torch.testing.assert_close(states[n], want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(states[0], s0)
    torch.testing.assert_close(last, gdr.recurrent_gated_delta_rule(q, k, v, g, beta, s0)[1], atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="multiples of 64"):
        gdr.chunk_gated_delta_rule(q, k, v, g, beta, s0, states_out={48: None})


def _against_the_reference(rule, lens: list[int], dv: int, seed: int, asked: list[dict]):
    """``rule`` (a ``chunk_gated_delta_rule_varlen``) against the plain-PyTorch one over sequences of ``lens``
    tokens (the first and last from a state, the others from zeros), with the states ``asked`` for inside
    the prefills: outputs, final states and those states. Returns ``(got, inputs, inits)``."""
    q, k, v, g, beta, _ = _rule_inputs(sum(lens), 3, 16, dv, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    inits = [torch.randn(3, 16, dv, generator=gen), None, None, torch.randn(3, 16, dv, generator=gen)]
    want_states, got_states = [dict(a) for a in asked], [dict(a) for a in asked]
    want = gdr.chunk_gated_delta_rule_varlen(q, k, v, g, beta, lens, inits, states_out=want_states)
    got = rule(q, k, v, g, beta, lens, inits, states_out=got_states)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    for got_i, want_i in zip(got_states, want_states):
        assert got_i.keys() == want_i.keys()
        for n in want_i:
            torch.testing.assert_close(got_i[n], want_i[n], atol=2e-5, rtol=1e-5)
    return got, (q, k, v, g, beta), inits


def test_fla_form_takes_snapshots_in_rounds(monkeypatch):
    """``linear_attention_backend="fla"``'s chunked rule (:mod:`infer.kernels.gated_delta_fla`): its kernel
    returns only final states, so a call that asks for states inside the prefills (prefix caching's
    snapshots) cuts each sequence at them and runs the pieces in rounds
    (:func:`~infer.kernels.gated_delta_reference.chunk_rule_in_rounds`). Here the kernel's call is the
    plain-PyTorch varlen form without ``states_out`` (fla's kernels run on a GPU, tests/test_gpu_phases.py):
    outputs, final states and the states asked for (0, chunk ends, the last token) equal one pass of the
    reference that takes them itself, in as many calls as the most-cut sequence has pieces, none of which
    asks the kernel for inner states."""
    from infer.kernels import gated_delta_fla

    calls = []

    def kernel(q, k, v, g, beta, lens, inits, scale, chunk_size):
        calls.append(list(lens))
        return gdr.chunk_gated_delta_rule_varlen(q, k, v, g, beta, lens, inits, scale, chunk_size)

    monkeypatch.setattr(gated_delta_fla, "_fla_rule", kernel)
    lens = [150, 1, 192, 70]
    _, (q, k, v, g, beta), inits = _against_the_reference(
        gated_delta_fla.chunk_gated_delta_rule_varlen, lens, 8, 5, [{64: None, 128: None}, {}, {0: None, 64: None,
                                                                                           192: None}, {}])
    assert calls == [[64, 1, 64, 70], [64, 128], [22]]  # round r: every sequence's r-th piece
    with pytest.raises(ValueError, match="multiples of 64"):
        gated_delta_fla.chunk_gated_delta_rule_varlen(q, k, v, g, beta, lens, inits, states_out=[{32: None}, {}, {}, {}])


def test_varlen_forms_equal_one_sequence_at_a_time():
    """A step's prefills in one call: four sequences of 150, 1, 64 and 70 tokens back to back (one ending
    on a chunk, one shorter than a chunk, two zero states, two resumed ones), their outputs, final states
    and the states at chunk ends asked for, against the recurrent form one sequence at a time; the
    convolution's outputs and states against :func:`causal_conv1d` per sequence."""
    lens = [150, 1, 64, 70]
    q, k, v, g, beta, _ = _rule_inputs(sum(lens), 3, 16, 8, seed=8)
    gen = torch.Generator().manual_seed(9)
    inits = [torch.randn(3, 16, 8, generator=gen), None, None, torch.randn(3, 16, 8, generator=gen)]
    states = [{64: None, 128: None}, {}, {0: None, 64: None}, {}]
    o, finals = gdr.chunk_gated_delta_rule_varlen(q, k, v, g, beta, lens, inits, states_out=states)
    at = 0
    for i, n in enumerate(lens):
        part = slice(at, at + n)
        want_o, want_s = gdr.recurrent_gated_delta_rule(q[part], k[part], v[part], g[part], beta[part], inits[i])
        torch.testing.assert_close(o[part], want_o, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(finals[i], want_s, atol=2e-5, rtol=1e-5)
        for count in states[i]:
            cut = slice(at, at + count)
            want = (gdr.recurrent_gated_delta_rule(q[cut], k[cut], v[cut], g[cut], beta[cut], inits[i])[1] if count
                    else torch.zeros(3, 16, 8) if inits[i] is None else inits[i])
            torch.testing.assert_close(states[i][count], want, atol=2e-5, rtol=1e-5)
        at += n
    with pytest.raises(ValueError, match="add up"):
        gdr.chunk_gated_delta_rule_varlen(q, k, v, g, beta, [150, 1])
    stacked = torch.stack([torch.zeros(3, 16, 8) if s is None else s for s in inits])  # one gathered tensor
    o2, finals2 = gdr.chunk_gated_delta_rule_varlen(q, k, v, g, beta, lens, stacked)
    torch.testing.assert_close(o2, o)
    torch.testing.assert_close(finals2, finals)

    x, weight = torch.randn(sum(lens), 6, generator=gen), torch.randn(6, 4, generator=gen)
    convs = [torch.randn(6, 3, generator=gen), None, torch.randn(6, 3, generator=gen), None]
    y = gdr.causal_conv1d_varlen(x, weight, lens, convs)
    torch.testing.assert_close(gdr.causal_conv1d_varlen(x, weight, lens, torch.stack(
        [torch.zeros(6, 3) if c is None else c for c in convs])), y)
    at = 0
    for i, n in enumerate(lens):
        want_y, want_state = gdr.causal_conv1d(x[at:at + n], weight, convs[i])
        torch.testing.assert_close(y[at:at + n], want_y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gdr.conv_state_after(x[at:at + n], convs[i], n, 3), want_state)
        torch.testing.assert_close(gdr.conv_state_after(x[at:at + n], convs[i], 0, 3),
                                   torch.zeros(6, 3) if convs[i] is None else convs[i])
        for m in {1, 2, 3, n // 2} - {0}:  # the state after fewer tokens: causal_conv1d over those
            if m <= n:
                torch.testing.assert_close(gdr.conv_state_after(x[at:at + n], convs[i], m, 3),
                                           gdr.causal_conv1d(x[at:at + m], weight, convs[i])[1])
        at += n


@interpreted
def test_triton_chunked_rule_matches_the_reference():
    """The prefills' chunked rule in infer's three Triton kernels
    (:func:`infer.kernels.gated_delta_triton.chunk_gated_delta_rule_varlen`: the UT transform per chunk, the
    chunk-to-chunk recurrence per sequence, the outputs per chunk) against the plain-PyTorch form and the
    token-by-token one: four sequences of 150, 1, 64 and 70 tokens (a partial last chunk, a one-token one,
    one ending on a chunk), two from a state, slow to fast decays; the outputs, the final states, and the
    states asked for inside the prefills (0, chunk ends, the last token), which the recurrence leaves in
    its buffer of chunk states."""
    from infer.kernels import gated_delta_triton as tri

    lens = [150, 1, 64, 70]
    got, (q, k, v, g, beta), inits = _against_the_reference(
        tri.chunk_gated_delta_rule_varlen, lens, 16, 12, [{64: None, 128: None}, {}, {0: None, 64: None}, {}])
    o_rec, s_rec = gdr.recurrent_gated_delta_rule(q[:150], k[:150], v[:150], g[:150], beta[:150], inits[0])
    torch.testing.assert_close(got[0][:150], o_rec, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got[1][0], s_rec, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="chunks of 64"):
        tri.chunk_gated_delta_rule_varlen(q, k, v, g, beta, lens, chunk_size=32)
    with pytest.raises(ValueError, match="multiples of 64"):
        tri.chunk_gated_delta_rule_varlen(q, k, v, g, beta, lens, states_out=[{32: None}, {}, {}, {}])


@interpreted
def test_triton_chunked_rule_takes_16_bit_products_on_16_bit_inputs():
    """On 16-bit inputs the Triton chunked rule keeps ``W``, ``U`` and the new values in the inputs' dtype and
    multiplies the walk's and the outputs' products in it (float32 accumulation; the UT transform stays in
    float32 tiles), as flash-linear-attention does: against the reference on the same values in float32,
    outputs, final and inner states within the 16-bit operands' rounding (fp16 here: bf16 is wrong in the
    Triton interpreter, its GPU twin is ``tests/test_gpu_phases.py``'s bf16 case). A float32 walk would
    agree to ~1e-6, so the bound also shows the 16-bit path is the one taken (errors ~5e-4 of the scale)."""
    from infer.kernels import gated_delta_triton as tri

    gen = torch.Generator().manual_seed(5)
    lens, h, d = [150, 1, 70], 4, 16
    t = sum(lens)
    q, k = (gdr.l2norm(torch.randn(t, h, d, generator=gen)).half() for _ in range(2))
    v = torch.randn(t, h, d, generator=gen).half()
    g, beta = -torch.rand(t, h, generator=gen) * 0.3, torch.rand(t, h, generator=gen)
    inits = [torch.randn(h, d, d, generator=gen) * 0.1, None, None]
    asked, want_states = [{64: None, 128: None}, {}, {}], [{64: None, 128: None}, {}, {}]
    want = gdr.chunk_gated_delta_rule_varlen(q.float(), k.float(), v.float(), g, beta, lens, inits,
                                             states_out=want_states)
    got = tri.chunk_gated_delta_rule_varlen(q, k, v, g, beta, lens, inits, states_out=asked)
    errors = []
    for a, b in [*zip(got, want), *((asked[0][n], want_states[0][n]) for n in (64, 128))]:
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=0, atol=3e-3 * scale)
        errors.append((a - b).abs().max().item() / scale)
    assert max(errors) > 2e-5  # not the float32 walk's agreement


@interpreted
def test_triton_prefill_rule_normalizes_and_gates_in_its_kernels():
    """:func:`infer.kernels.gated_delta_triton.prefill_rule`: the same three kernels fed the convolution's output
    and the projections' ``a`` and ``b`` as the layer has them (column slices of wider tensors), the L2
    norms, the key head each value head reads (2 key heads for 4 value heads) and the gating (``a`` past
    softplus's linear threshold included) computed inside, against the reference's ``prefill_rule``
    (:func:`~infer.kernels.gated_delta_reference.split_qkv`, ``gating``, the chunked rule): outputs, final
    states and a state inside a prefill."""
    from infer.kernels import gated_delta_triton as tri

    gen = torch.Generator().manual_seed(21)
    lens, hk, hv, dk, dv = [70, 1, 130], 2, 4, 16, 16
    t, width = sum(lens), 2 * hk * dk + hv * dv
    y = torch.randn(t, width + 8, generator=gen)[:, 8:]
    ab = torch.randn(t, 2 * hv + 3, generator=gen) * 3.0
    ab[0, 0] = 100.0  # softplus(a + dt_bias) is linear there (exp would overflow float32)
    a, b = ab[:, :hv], ab[:, hv:2 * hv]
    a_log, dt_bias = torch.rand(hv, generator=gen) - 0.5, torch.rand(hv, generator=gen)
    inits = [torch.randn(hv, dk, dv, generator=gen), None, torch.randn(hv, dk, dv, generator=gen)]
    args = (y, a, b, a_log, dt_bias, hk, dk, hv, dv, lens, inits)
    want_states, got_states = [{64: None}, {}, {128: None}], [{64: None}, {}, {128: None}]
    want = gdr.prefill_rule(*args, states_out=want_states)
    got = tri.prefill_rule(*args, states_out=got_states)
    for x, ref in [*zip(got, want), (got_states[0][64], want_states[0][64]), (got_states[2][128], want_states[2][128])]:
        torch.testing.assert_close(x, ref, atol=5e-5, rtol=1e-5)
    stacked = torch.stack([torch.zeros(hv, dk, dv) if s is None else s for s in inits])  # the states gathered at once
    for x, ref in zip(tri.prefill_rule(*args[:-1], stacked), want):
        torch.testing.assert_close(x, ref, atol=5e-5, rtol=1e-5)


@interpreted
def test_triton_varlen_convolution_matches_the_reference():
    """The prefills' convolution kernel (:func:`infer.kernels.gated_delta_triton.causal_conv1d_varlen`)
    against the plain-PyTorch form: five sequences back to back (1, 2, 3 and 40 tokens and one of 70, so
    taps reach into a state, into zeros, and across several row blocks), states for some, ``x`` a column
    slice of a wider tensor (the merged in-projection), a channel count off the block size."""
    from infer.kernels import gated_delta_triton as tri

    gen = torch.Generator().manual_seed(11)
    lens, c = [1, 40, 2, 70, 3], 200
    wide = torch.randn(sum(lens), c + 24, generator=gen)
    x, weight = wide[:, 8:8 + c], torch.randn(c, 4, generator=gen)
    convs = [torch.randn(c, 3, generator=gen), None, torch.randn(c, 3, generator=gen), None,
             torch.randn(c, 3, generator=gen)]
    want = gdr.causal_conv1d_varlen(x, weight, lens, convs)
    torch.testing.assert_close(tri.causal_conv1d_varlen(x, weight, lens, convs), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tri.causal_conv1d_varlen(x, weight, lens, [None] * 5),
                               gdr.causal_conv1d_varlen(x, weight, lens, [None] * 5), atol=1e-5, rtol=1e-5)
    stacked = torch.stack([torch.zeros(c, 3) if s is None else s for s in convs])  # zeros: a fresh sequence
    torch.testing.assert_close(tri.causal_conv1d_varlen(x, weight, lens, stacked), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="add up"):
        tri.causal_conv1d_varlen(x, weight, [1, 2], [None, None])


def test_prefill_states_gather_and_conv_states_equal_the_per_sequence_forms():
    """:class:`~infer.models.qwen3_5.PrefillStates`, which reads and writes every prefill's state in one op per
    layer: its gather gives each resumed sequence its slot's state and a fresh one zeros (its slot holds NaN
    leftovers here), and its conv states after each prefill and after the snapshot counts equal
    :func:`~infer.kernels.gated_delta_reference.conv_state_after` per sequence, for sequences shorter than
    the ``K - 1`` taps (part of the state comes from before the step), with and without a state."""
    from infer.models.qwen3_5 import PrefillStates

    gen = torch.Generator().manual_seed(5)
    lens, resume, slots, c, w = [1, 2, 7, 40], [True, False, True, False], [6, 0, 3, 2], 5, 3
    starts = [sum(lens[:j]) for j in range(len(lens))]
    snaps = [(3, 0, 9), (2, 2, 8), (3, 33, 7), (0, 1, 5)]  # (prefill, token count, snapshot slot)
    pool = torch.full((10, c, w), float("nan"))
    for slot, keep in zip(slots, resume):
        if keep:
            pool[slot] = torch.randn(c, w, generator=gen)
    io = PrefillStates(slots, resume, starts, lens, snaps, w, torch.device("cpu"))
    conv0 = io.gather(pool)
    inits = [pool[slot] if keep else None for slot, keep in zip(slots, resume)]
    for j, init in enumerate(inits):
        torch.testing.assert_close(conv0[j], torch.zeros(c, w) if init is None else init)
    x = torch.randn(sum(lens), c + 4, generator=gen)[:, 2:2 + c]  # a column slice, as the layer's rows are
    seq = [x[s:s + n] for s, n in zip(starts, lens)]
    got = io.conv_states_after(x, conv0, io.ends)
    for j, n in enumerate(lens):
        torch.testing.assert_close(got[j], gdr.conv_state_after(seq[j], inits[j], n, w))
    got = io.conv_states_after(x, conv0, io.snap_ends)
    for m, (j, end, _) in enumerate(snaps):
        torch.testing.assert_close(got[m], gdr.conv_state_after(seq[j], inits[j], end, w))
    assert io.snap_slots.tolist() == [9, 8, 7, 5] and io.snaps == [(3, 0), (2, 2), (3, 33), (0, 1)]
    fresh = PrefillStates([1, 4], [False, False], [0, 1], [1, 2], [], w, torch.device("cpu"))
    assert fresh.gather(pool) is None and not fresh.snaps
    torch.testing.assert_close(fresh.conv_states_after(x[:3], None, fresh.ends)[0],
                               gdr.conv_state_after(x[:1], None, 1, w))


def test_conv1d_update_steps_equal_the_prefill_convolution():
    """The same tokens one at a time from a zero state (batched over two rows) equal the prefill form, and
    so does the prefill split in two calls (the state carries the last K - 1 inputs across)."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(11, 6, generator=g), torch.randn(6, 4, generator=g)
    y, state = gdr.causal_conv1d(x, w, None)
    s, ys = torch.zeros(2, 6, 3), []
    for i in range(11):
        yi, s = gdr.causal_conv1d_update(x[i].expand(2, 6), s, w)
        ys.append(yi[1])
    torch.testing.assert_close(torch.stack(ys), y, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s[0], state)
    y1, s1 = gdr.causal_conv1d(x[:5], w, None)
    y2, s2 = gdr.causal_conv1d(x[5:], w, s1)
    torch.testing.assert_close(torch.cat([y1, y2]), y)
    torch.testing.assert_close(s2, state)


def test_delta_rule_and_conv1d_equal_hf():
    """Both forms of the rule against Hugging Face's torch fallbacks (its chunked and recurrent
    ``qwen3_5`` functions), GQA-free heads, nonzero initial state; the convolution against its
    ``causal_conv1d_fn``."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    q, k, v, g, beta, s0 = _rule_inputs(150, 3, 16, 8, seed=0)
    o_chk, s_chk = gdr.chunk_gated_delta_rule(q, k, v, g, beta, s0)
    o_hf, s_hf = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial_state=s0[None],
                                                 output_final_state=True)
    torch.testing.assert_close(o_chk, o_hf[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s_chk, s_hf[0], atol=2e-5, rtol=1e-5)
    o_rec, s_rec = gdr.recurrent_gated_delta_rule(q[:9], k[:9], v[:9], g[:9], beta[:9], s0)
    o_hf, s_hf = hf.torch_recurrent_gated_delta_rule(q[None, :9], k[None, :9], v[None, :9], g[None, :9],
                                                     beta[None, :9], initial_state=s0[None], output_final_state=True)
    torch.testing.assert_close(o_rec, o_hf[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_rec, s_hf[0], atol=1e-5, rtol=1e-5)
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(11, 6, generator=gen), torch.randn(6, 4, generator=gen)
    torch.testing.assert_close(gdr.causal_conv1d(x, w, None)[0],
                               hf.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t())


# ---------------------------------------------------------------------------------- the model


@pytest.fixture(scope="module")
def tiny_qwen35(tmp_path_factory):
    """``tiny-qwen3.5`` written by transformers, loaded by infer and by HF (float32, CPU)."""
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from infer.loader import load_model

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    path = make_checkpoint("tiny-qwen3.5", tmp_path_factory.mktemp("tiny-qwen3.5"), dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return load_model(path, device="cpu", dtype=torch.float32, progress=False), hf


def test_logits_match_hf_over_several_chunks(tiny_qwen35):
    """Teacher-forced logits of a 150-token prompt (3 chunks of the delta rule) and a short one, in one
    flattened batch, against HF's forward of each."""
    from tests.hf_reference import hf_logits, infer_logits

    loaded, hf = tiny_qwen35
    assert loaded.config.layer_types.count("linear_attention") == 3 and loaded.config.num_kv_layers == 1
    assert loaded.config.num_params() == sum(p.numel() for p in hf.parameters())
    seqs = [[(7 * i + 3) % 500 for i in range(150)], [5, 6, 7]]
    for seq, got in zip(seqs, infer_logits(loaded.model, seqs)):
        ref = hf_logits(hf, seq)
        assert (got - ref).abs().max().item() <= 1e-4, (got - ref).abs().max().item()


PROMPTS = [[5, 6, 7], list(range(100, 164)), [300] * 17, [42], list(range(200, 240))]
N_OUT = 6


@pytest.fixture(scope="module")
def hf_greedy_tokens(tiny_qwen35):
    from tests.test_generation import hf_greedy

    return [hf_greedy(tiny_qwen35[1], p, N_OUT) for p in PROMPTS]


def _slots_consistent(engine) -> None:
    """Every running sequence holds a distinct slot; held + free slots are all of them, once."""
    kv = engine.kv_manager
    held = [s.state_slot for s in engine.scheduler.running]
    assert all(s >= 0 for s in held) and len(set(held)) == len(held)
    assert sorted(held + kv.free_state_slots) == list(range(kv.num_state_slots))


def _assert_drained(engine) -> None:
    from tests.test_batching import assert_pool_full

    assert_pool_full(engine)
    assert sorted(engine.kv_manager.free_state_slots) == list(range(engine.kv_manager.num_state_slots))


ENGINES = {
    "phase1": dict(),
    # continuous batching, paged KV, chunked prefill with a 16-token budget (the 64-token prompt runs in
    # chunks beside the others' decodes), async scheduling
    "paged-chunked-async": dict(batching="continuous", kv_cache="paged", block_size=8, chunked_prefill=True,
                                max_num_batched_tokens=16, async_scheduling=True),
    # the Triton attention kernels and the Gated DeltaNet kernels: decode step, prefill convolution and
    # chunked rule (interpreted on the CPU)
    "triton": dict(batching="continuous", kv_cache="paged", block_size=8, attention_backend="triton",
                   linear_attention_backend="triton"),
    # and the fused forward: the gated attention's norm + RoPE kernel writing the KV cache
    "triton-fused": dict(batching="continuous", kv_cache="paged", block_size=8, attention_backend="triton",
                         linear_attention_backend="triton", fused_kernels=True),
}


def test_bfloat16_state_engine_keeps_hfs_greedy_tokens(tiny_qwen35, hf_greedy_tokens):
    """The engine with ``ssm_state_dtype='bfloat16'`` (chunked prefill carrying the state across chunks in its
    bfloat16 slots, decode steps rounding it once a step): its state slots take the bytes hand-computed for a
    bfloat16 ``[Hv, Dk, Dv]`` per linear layer, and its greedy tokens are HF's float32 ones for every prompt."""
    from infer.sampling import SamplingParams
    from tests.test_batching import drive, make_engine

    loaded, _ = tiny_qwen35
    cfg = loaded.config
    engine = make_engine(loaded, max_model_len=128, max_num_seqs=4, ssm_state_dtype="bfloat16",
                         **ENGINES["paged-chunked-async"])
    cache = engine.runner.state_cache
    layers = cfg.layer_types.count("linear_attention")
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * \
        cfg.linear_value_head_dim
    assert cache.ssm.dtype == torch.bfloat16
    assert cache.slot_nbytes == layers * (conv_dim * (cfg.linear_conv_kernel_dim - 1) * 4 + cfg.linear_num_value_heads
                                          * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 2)
    assert cache.slot_nbytes == cfg.state_bytes_per_seq(torch.float32, torch.bfloat16)
    params = SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True)
    got = drive(engine, [(i % 3, p, params) for i, p in enumerate(PROMPTS)], check=_slots_consistent)
    assert engine.scheduler.num_chunked_steps > 0, "no prompt was chunked"
    for i in range(len(PROMPTS)):
        assert got[i][0] == hf_greedy_tokens[i], f"prompt {i}"
    _assert_drained(engine)


@pytest.mark.parametrize("flags", [pytest.param(f, marks=interpreted) if f.startswith("triton") else f
                                   for f in ENGINES])
def test_engine_greedy_tokens_equal_hf_generate(tiny_qwen35, hf_greedy_tokens, flags, monkeypatch):
    from infer.kernels import fused_triton
    from infer.sampling import SamplingParams
    from tests.test_batching import drive, make_engine

    loaded, _ = tiny_qwen35
    params = SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True)
    writes = []  # (triton-fused) the steps whose KV-cache write the norm + RoPE kernel did
    real = fused_triton.gated_qk_norm_rope
    monkeypatch.setattr(fused_triton, "gated_qk_norm_rope", lambda *a, **kw: (
        writes.append(kw.get("kv_cache") is not None), real(*a, **kw))[1])
    engine = make_engine(loaded, max_model_len=128, max_num_seqs=4, **ENGINES[flags])
    which = [0, 3, 2] if flags.startswith("triton") else range(len(PROMPTS))  # interpreted kernels: the short ones
    got = drive(engine, [(i % 3, PROMPTS[p], params) for i, p in enumerate(which)], check=_slots_consistent)
    for i, p in enumerate(which):
        assert got[i][0] == hf_greedy_tokens[p], f"prompt {p}"
    if flags == "paged-chunked-async":
        assert engine.scheduler.num_chunked_steps > 0, "no prompt was chunked"
    if flags == "triton-fused":
        assert writes and all(writes), writes
    _assert_drained(engine)


def _budget(cfg, slots: int, blocks: int, block_size: int) -> int:
    """kv_cache_memory_bytes that :func:`~infer.engine.memory.split_state_budget` splits into ``slots``
    state slots (they take at most half) and ``blocks`` KV blocks."""
    slot = cfg.state_bytes_per_seq(torch.float32)
    block = cfg.kv_bytes_per_token(torch.float32) * block_size
    budget = slots * slot + blocks * block
    assert min(4, budget // 2 // slot) == slots, "pick more blocks: the slots must fit half the budget"
    return budget


def test_slot_exhaustion_waits_and_preemption_frees_slots(tiny_qwen35, hf_greedy_tokens):
    """Two state slots for up to four running sequences: requests wait for a slot instead of failing;
    a KV pool of 9 blocks of 16 tokens forces preemptions (recompute: two 64-token prompts take 8
    blocks, and both need a fifth as they decode), whose sequences give their slot back and,
    readmitted, restart from a zero state. After every step the slots are consistent, and every output
    still equals HF's."""
    from infer.sampling import SamplingParams
    from tests.test_batching import drive, make_engine

    loaded, _ = tiny_qwen35
    cfg = loaded.config
    params = SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True)
    engine = make_engine(loaded, max_model_len=96, max_num_seqs=4, batching="continuous", kv_cache="paged",
                         block_size=16, kv_cache_memory_bytes=_budget(cfg, 2, 9, 16))
    assert engine.kv_manager.num_state_slots == 2 and engine.kv_manager.num_blocks == 9
    widths = []

    def check(e):
        _slots_consistent(e)
        widths.append(len(e.scheduler.running))

    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[4]]
    got = drive(engine, [(0, p, params) for p in prompts], check=check)
    for i, p in enumerate(prompts):
        assert got[i][0] == hf_greedy_tokens[PROMPTS.index(p)], f"prompt {i}"
    assert max(widths) == 2, "the slots did not limit the batch"
    assert engine.scheduler.num_preemptions > 0, "the workload never preempted"
    _assert_drained(engine)


def test_abort_and_forks_free_slots(tiny_qwen35, hf_greedy_tokens):
    """An aborted request gives its slots back at once; ``n = 2`` greedy sequences share one prefill,
    each fork starting from a copy of the prompt's state (both equal HF's tokens)."""
    from infer.sampling import SamplingParams
    from tests.test_batching import make_engine

    loaded, _ = tiny_qwen35
    engine = make_engine(loaded, max_model_len=128, max_num_seqs=4, batching="continuous", kv_cache="paged",
                         block_size=8)
    greedy = dict(max_tokens=N_OUT, temperature=0.0, ignore_eos=True)
    engine.add_request(PROMPTS[1], SamplingParams(**greedy), request_id="victim")
    engine.add_request(PROMPTS[4], SamplingParams(n=2, **greedy), request_id="forks")
    engine.step()
    assert len(engine.kv_manager.free_state_slots) == engine.kv_manager.num_state_slots - 3
    engine.abort_request("victim")
    assert len(engine.kv_manager.free_state_slots) == engine.kv_manager.num_state_slots - 2
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = [o.token_ids for o in out.outputs]
    assert outs["forks"] == [hf_greedy_tokens[4]] * 2
    _assert_drained(engine)


def test_hybrid_flags_and_budget_split(tiny_qwen35, monkeypatch):
    """prefix_caching is accepted for a hybrid model (and kept under ``optimize``); what does not handle
    the state yet is refused with its reason; the stride and the linear-attention backend are checked; the
    budget splits follow their rules."""
    from infer.config import EngineConfig
    from infer.engine.memory import split_snapshot_budget, split_state_budget
    from infer.engine.state_snapshots import snapshot_stride

    cfg = tiny_qwen35[0].config
    EngineConfig(model="x", device="cpu", kv_cache="paged", prefix_caching=True).validate().validate_model(cfg)
    opt = EngineConfig(model="x", device="cpu", optimize=True).validate()
    opt.validate_model(cfg)
    assert opt.prefix_caching and "prefix_caching" not in opt.optimization_notes
    for kw, name in [({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative_config"),
                     ({"enable_lora": True}, "enable_lora"),
                     ({"kv_cache": "paged", "prefix_caching": True, "kv_offload": "host"}, "kv_offload")]:
        with pytest.raises(ValueError, match=f"{name} is not supported for hybrid models"):
            EngineConfig(model="x", device="cpu", **kw).validate().validate_model(cfg)
    with pytest.raises(ValueError, match="state_snapshot_stride must be .* multiple of block_size=16"):
        EngineConfig(model="x", device="cpu", kv_cache="paged", state_snapshot_stride=24).validate()
    # flash-linear-attention's chunked rule: Triton kernels for GPUs only
    with pytest.raises(ValueError, match="linear_attention_backend='fla' needs a CUDA device"):
        EngineConfig(model="x", device="cpu", linear_attention_backend="fla").validate()
    with pytest.raises(ValueError, match="linear_attention_backend must be one of auto, torch, triton, fla"):
        EngineConfig(model="x", device="cpu", linear_attention_backend="cuda").validate()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # infer's Triton kernels: on a CPU only interpreted
    with pytest.raises(ValueError, match="linear_attention_backend='triton' on the CPU needs the Triton interpreter"):
        EngineConfig(model="x", device="cpu", linear_attention_backend="triton").validate()
    # the default: infer's Triton kernels on CUDA (measured faster than the reference and fla), the reference on a CPU
    assert EngineConfig(model="x", device="cpu").validate().resolved_linear_attention_backend() == "torch"
    assert EngineConfig(model="x", device="cuda").resolved_linear_attention_backend() == "triton"
    assert EngineConfig(model="x", device="cuda", linear_attention_backend="fla").resolved_linear_attention_backend() == "fla"
    assert snapshot_stride(0, 16) == 256 and snapshot_stride(0, 48) == 288 and snapshot_stride(32, 16) == 32
    assert split_state_budget(10_000, 100, 8) == 8 and split_state_budget(1_000, 100, 8) == 5
    with pytest.raises(ValueError, match="recurrent-state slot"):
        split_state_budget(150, 100, 8)
    # snapshots: one per stride of the blocks the rest holds (x * 100 + 2x * 50 = 10_000: 50), at most half
    # the budget, no more than the block cap can use, leaving the reserve
    assert split_snapshot_budget(10_000, 100, 0, 50, 8, 16, 10**6) == 50
    assert split_snapshot_budget(10_000, 1000, 0, 1, 8, 16, 10**6) == 5
    assert split_snapshot_budget(10_000, 100, 0, 50, 8, 16, 40) == 20
    assert split_snapshot_budget(10_000, 100, 9_950, 50, 8, 16, 10**6) == 0


# ---------------------------------------------------------------------------------- prefix caching (snapshots)

HYBRID_PREFIX = [(7 * i + 3) % 500 for i in range(70)]
SNAPSHOT_FLAGS = dict(max_model_len=128, max_num_seqs=4, batching="continuous", kv_cache="paged", block_size=8,
                      chunked_prefill=True, max_num_batched_tokens=24)  # 24-token chunks end off the 16-token stride


def _one_at_a_time(engine, prompts, params):
    """Each prompt run to completion alone, in order: (output tokens, num_cached_tokens) per prompt."""
    outs = []
    for p in prompts:
        engine.add_request(p, params)
        while engine.has_unfinished_requests():
            outs += [(o.outputs[0].token_ids, o.num_cached_tokens) for o in engine.step() if o.finished]
        engine.kv_manager.check_invariants()
    return outs


def test_snapshot_lookup_cuts_a_hit_back_to_its_last_snapshot():
    """The snapshot pool alone, hand-computed: a stride of 4 blocks of 8 tokens; a hit is cut back to its
    last block that owns a snapshot (none: nothing reused); a full pool drops the snapshot of the least
    recently freed cached block, or skips when every snapshot belongs to a block in use."""
    from infer.engine.state_snapshots import StateSnapshotPool

    pool = StateSnapshotPool(first_slot=4, num_slots=2, stride=32, block_size=8)
    hit = list(range(10, 20))  # 10 blocks: 80 tokens
    assert pool.usable_hit(hit) == [] and list(pool.boundaries(20, 70)) == [32, 64]
    assert pool.take(13, []) == 4 and pool.take(17, []) == 5 and pool.take(17, []) == -1
    assert pool.usable_hit(hit) == hit[:8]  # the snapshot at 64 tokens
    assert pool.usable_hit(hit[:7]) == hit[:4] and pool.usable_hit(hit[:4]) == hit[:4]
    assert pool.usable_hit(hit[:3]) == [] and pool.usable_hit([]) == []
    assert pool.take(21, [30, 17, 13]) == 5  # full: block 17 (the older of the two cached) loses its snapshot
    assert pool.usable_hit(hit) == hit[:4] and pool.num_evicted == 1
    assert pool.take(25, []) == -1 and pool.num_skipped == 1  # both owners in use
    pool.forget(13)
    assert pool.usable_hit(hit) == [] and sorted(pool.free_slots) == [4]
    pool.check_invariants()


def test_prefix_hits_restore_snapshots_and_equal_a_cold_run(tiny_qwen35):
    """A 70-token prompt, then prompts sharing 70, 40, 12 (under one stride: no reuse) and 33 tokens of it
    (the hit ends on a snapshot, one token is recomputed) and a next chat turn that takes the first
    reply in (its snapshot at 80 tokens was taken by a decode step): every greedy output equals a cold
    engine's, each hit is cut back to the last 16-token snapshot at or below it, and the snapshot
    counters add up."""
    from infer.sampling import SamplingParams
    from tests.test_batching import make_engine

    loaded, _ = tiny_qwen35
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    p = HYBRID_PREFIX
    prompts = [p, p, p[:40] + [9, 8, 7, 6], p[:12] + [1, 2, 3], p[:33]]
    cold = _one_at_a_time(make_engine(loaded, **SNAPSHOT_FLAGS), prompts, params)
    follow = p + cold[0][0][:11] + [4, 4, 4]  # the reply's tokens 70..80 are in the cache, with their state
    cold += _one_at_a_time(make_engine(loaded, **SNAPSHOT_FLAGS), [follow], params)
    engine = make_engine(loaded, prefix_caching=True, state_snapshot_stride=16, **SNAPSHOT_FLAGS)
    warm = _one_at_a_time(engine, prompts + [follow], params)
    assert [w[0] for w in warm] == [c[0] for c in cold]
    assert [w[1] for w in warm] == [0, 64, 32, 0, 32, 80]
    stats = engine.prefix_cache_stats()
    assert stats["prefix_cache_snapshot_hits"] == 4
    # the first prompt's 70 + 11 computed tokens: 16, 32, 48, 64, 80; its repeat recomputes 64..81 and takes
    # 80 on a block of its own, dropped at the end (the first one's block holds that key); 48 and 16 of the
    # prompts that diverge at 40 and 12; the 33-token prompt (44 computed) and the follow-up (95) reach none
    assert stats["prefix_cache_snapshots_stored"] == 8 and stats["prefix_cache_snapshots_evicted"] == 1
    from infer.server.metrics import SchedulerCollector

    families = {f.name: f.samples[0].value for f in SchedulerCollector(engine.scheduler, "m").collect()}
    assert (families["infer:prefix_cache_snapshot_hits"], families["infer:prefix_cache_snapshots_stored"],
            families["infer:prefix_cache_snapshots_evicted"]) == (4, 8, 1)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreted)])
def test_snapshots_on_chunk_ends_come_from_one_pass_and_equal_a_cold_run(tiny_qwen35, backend):
    """A 64-token stride (a multiple of the chunked form's 64-token chunks): a whole prompt's prefill runs
    as one pass that takes its snapshots on the way (the plain-PyTorch form, or infer's Triton kernels,
    which store them from the recurrence). A 150-token prompt, then prompts sharing 140 and 70 tokens of it:
    each hit is cut back to the snapshot at 128 or 64, and every greedy output equals an engine's without
    prefix caching."""
    from infer.sampling import SamplingParams
    from tests.test_batching import make_engine

    loaded, _ = tiny_qwen35
    flags = dict(max_model_len=256, max_num_seqs=4, batching="continuous", kv_cache="paged", block_size=8,
                 linear_attention_backend=backend)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    p = HYBRID_PREFIX + HYBRID_PREFIX[::-1] + [5] * 10
    prompts = [p, p[:140] + [1, 2, 3], p[:70] + [4, 5]]
    cold = _one_at_a_time(make_engine(loaded, **flags), prompts, params)
    warm = _one_at_a_time(make_engine(loaded, prefix_caching=True, state_snapshot_stride=64, **flags), prompts,
                          params)
    assert [w[0] for w in warm] == [c[0] for c in cold]
    assert [w[1] for w in warm] == [0, 128, 64]


def test_prefill_chunks_resume_on_chunk_boundaries_and_keep_the_one_pass(tiny_qwen35, monkeypatch):
    """Hybrid prefix caching with chunked prefill: the scheduler cuts a partial chunk back to a multiple of
    the chunked rule's 64 tokens (``prefill_chunk_alignment``), so the next chunk's snapshots fall on chunk
    ends and every step's prefills run in the one pass; without the cut (alignment 1) a step falls back to
    each sequence alone. Prompts admitted together over a 100-token budget; the greedy tokens equal an
    engine's without prefix caching either way."""
    from infer.kernels import gated_delta_reference as gdr
    from infer.sampling import SamplingParams
    from tests.test_batching import make_engine

    loaded, _ = tiny_qwen35
    flags = dict(max_model_len=256, max_num_seqs=8, batching="continuous", kv_cache="paged", block_size=8,
                 chunked_prefill=True, max_num_batched_tokens=100)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate((90, 150, 70, 130))]
    per_sequence = []
    stock = gdr.chunk_gated_delta_rule
    monkeypatch.setattr(gdr, "chunk_gated_delta_rule", lambda *a, **k: per_sequence.append(1) or stock(*a, **k))

    def run(**kw):
        engine = make_engine(loaded, **flags, **kw)
        for p in prompts:
            engine.add_request(p, params)
        got = {}
        while engine.has_unfinished_requests():
            for o in engine.step(stream=False):
                if o.finished:
                    got[o.request_id] = o.outputs[0].token_ids
        return [got[k] for k in sorted(got, key=lambda r: int(r.split("-")[1]))], engine

    cold, _ = run()
    per_sequence.clear()
    warm, engine = run(prefix_caching=True, state_snapshot_stride=64)
    assert engine.scheduler.prefill_chunk_alignment == 64 and engine.scheduler.num_chunked_steps > 0
    assert warm == cold and not per_sequence
    engine.scheduler.prefill_chunk_alignment = 1  # the cut undone: a chunk resumes mid-chunk
    for p in prompts:
        engine.add_request([t + 1 for t in p], params)
    while engine.has_unfinished_requests():
        engine.step(stream=False)
    assert per_sequence, "no step fell back to the per-sequence path without the cut"


def test_snapshot_pool_stress_eviction_preemption_abort(tiny_qwen35):
    """Three running slots, three snapshot slots and 25 blocks of 8 tokens for requests that share
    prefixes of two prompts at several lengths, arriving over time: snapshots are evicted for room and
    with their blocks, a sequence is preempted (readmitted, its hit is looked up again) and one request
    is aborted as soon as it runs (async scheduling: each step is planned while the last one runs); the
    prefix cache is reset once mid-run;
    every pool is checked after every step, the greedy outputs equal a cold engine's, and at the end
    every running slot is free and only cached free blocks hold snapshots."""
    from infer.sampling import SamplingParams
    from tests.test_batching import drive, make_engine

    loaded, _ = tiny_qwen35
    a, b = HYBRID_PREFIX, [(11 * i + 5) % 500 for i in range(70)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # the first three outgrow the 25 blocks together (11 + 11 + 9); the rest reuse a's and b's prefixes
    prompts = [(0, a), (0, b), (0, [(13 * i + 1) % 500 for i in range(50)]), (12, a[:33] + [1, 2]),
               (12, b[:40] + [3] * 9), (14, a + [5]), (16, b[:17] + [3] * 30), (18, a[:20]), (20, b),
               (22, a[:48] + [7, 7])]
    arrivals = [(step, q, params) for step, q in prompts]
    flags = dict(max_model_len=96, max_num_seqs=3, batching="continuous", kv_cache="paged", block_size=8,
                 chunked_prefill=True, max_num_batched_tokens=40, async_scheduling=True)
    cold = drive(make_engine(loaded, **flags), arrivals)
    engine = make_engine(loaded, prefix_caching=True, state_snapshot_stride=16, kv_cache_memory_bytes=153_248,
                         **flags)
    kv = engine.kv_manager
    assert (kv.num_state_slots, kv.snapshots.num_slots, kv.num_blocks) == (3, 3, 25)

    def check(e):
        kv.check_invariants()
        _slots_consistent(e)
        for s in e.scheduler.running:  # a pending restore is the snapshot of a block the sequence holds
            assert s.state_restore < 0 or s.state_restore in (kv.snapshots.of_block.get(b) for b in s.block_table)
        if "r5" in e.requests and any(s in e.scheduler.running for s in e.requests["r5"].seqs):
            e.abort_request("r5")  # as soon as it runs: mid-prefill (its 71 tokens take two 40-token steps)
        if e.scheduler.num_steps == 30:
            assert e.scheduler.running
            resets.append(e.reset_prefix_cache())  # blocks in use keep their snapshots until freed

    resets = []
    warm = drive(engine, arrivals, check=check)
    assert warm[5] is None and len(resets) == 1
    assert all(warm[i] == cold[i] for i in range(len(prompts)) if i != 5)
    assert all(s.state_restore < 0 for r in engine.requests.values() for s in r.seqs)
    stats = engine.prefix_cache_stats()
    assert stats["prefix_cache_snapshot_hits"] > 0 and stats["prefix_cache_snapshots_evicted"] > 0
    assert engine.scheduler.num_preemptions > 0, "the workload never preempted"
    assert sorted(kv.free_state_slots) == list(range(kv.num_state_slots))
    assert all(c == 0 for c in kv.pool.ref_counts)
    assert set(kv.snapshots.of_block) <= set(kv.pool.cached_free)
    kv.check_invariants()


# ---------------------------------------------------------------------------------- the Triton decode step


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_step_equals_reference(dtype):
    """The two kernels (conv1d update, gated delta step with its gating) against the plain-PyTorch decode
    step on fresh random inputs: GQA (2 key heads for 4 value heads), Dv wider than one 32-column block,
    one sequence starting from a zero state, slots out of order, the inputs column slices of one merged
    projection's output (as the fused forward passes them), an ``a`` past softplus' linear threshold;
    the slots they write and those they leave alone."""
    from infer.kernels import gated_delta_triton as tri

    gen = torch.Generator().manual_seed(3)
    nk, hv, dk, dv, kernel, num_slots = 2, 4, 16, 48, 4, 6
    c = 2 * nk * dk + hv * dv
    merged = torch.randn(3, c + 2 * hv + 5, generator=gen).to(dtype)  # [qkv | b | a | 5 more columns]
    merged[0, c + hv] = 25.0  # softplus(25 + dt_bias) is linear
    mixed, b, a = merged[:, :c], merged[:, c:c + hv], merged[:, c + hv:c + 2 * hv]
    a_log, dt_bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    weight = torch.randn(c, kernel, generator=gen).to(dtype)
    conv = torch.randn(num_slots, c, kernel - 1, generator=gen).to(dtype)
    ssm = torch.randn(num_slots, hv, dk, dv, generator=gen)
    slots = torch.tensor([4, 1, 2])
    has = torch.tensor([True, False, True])
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    ref = gdr.decode_step(mixed, a, b, a_log, dt_bias, conv_ref, ssm_ref, slots, has, weight, nk)
    out = tri.decode_step(mixed, a, b, a_log, dt_bias, conv, ssm, slots, has, weight, nk)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(ssm, ssm_ref, **tol)
    torch.testing.assert_close(conv, conv_ref, atol=0, rtol=0)  # a shift: exact
    untouched = [s for s in range(num_slots) if s not in slots.tolist()]
    assert torch.equal(ssm[untouched], ssm_ref[untouched])


@pytest.mark.parametrize("ops", ["reference", pytest.param("triton", marks=interpreted)])
def test_bfloat16_state_slots_hold_the_float32_update_rounded(ops):
    """``ssm_state_dtype='bfloat16'``: a decode step reads a bfloat16 slot into float32, updates it there and
    stores it rounded once. So its output equals a float32 step's from the same (bf16-valued) state, and the
    slot it leaves equals that step's new state rounded to bfloat16 (the reference bit for bit; the kernel to
    within its float32 summation order); slots of other sequences are untouched."""
    from infer.kernels import gated_delta_triton as tri

    impl = tri if ops == "triton" else gdr
    gen = torch.Generator().manual_seed(8)
    nk, hv, dk, dv, kernel, num_slots = 2, 4, 16, 48, 4, 5
    c = 2 * nk * dk + hv * dv
    mixed, a, b = torch.randn(3, c, generator=gen), torch.randn(3, hv, generator=gen), torch.randn(3, hv, generator=gen)
    a_log, dt_bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    weight, conv = torch.randn(c, kernel, generator=gen), torch.randn(num_slots, c, kernel - 1, generator=gen)
    state = torch.randn(num_slots, hv, dk, dv, generator=gen).to(torch.bfloat16)
    slots, has = torch.tensor([3, 0, 1]), torch.tensor([True, True, False])
    full = state.float()
    want = gdr.decode_step(mixed, a, b, a_log, dt_bias, conv.clone(), full, slots, has, weight, nk)
    got = impl.decode_step(mixed, a, b, a_log, dt_bias, conv.clone(), state, slots, has, weight, nk)
    assert state.dtype == torch.bfloat16
    if ops == "reference":
        assert torch.equal(got, want) and torch.equal(state, full.to(torch.bfloat16))
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state.float(), full.to(torch.bfloat16).float(), atol=1e-5, rtol=2.0 ** -7)
    assert torch.equal(state[[2, 4]].float(), full[[2, 4]])


def test_gating_is_hf_qwen35s():
    """``gating`` against the formula of Hugging Face's Qwen3.5 layer written out in float64: the decay's log
    ``-exp(A_log) * log(1 + exp(a + dt_bias))`` and ``beta = sigmoid(b)``."""
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(4, 6, generator=gen) * 4, torch.randn(4, 6, generator=gen)
    a_log, dt_bias = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    g, beta = gdr.gating(a, b, a_log, dt_bias)
    want_g = -a_log.double().exp() * torch.log1p((a.double() + dt_bias.double()).exp())
    torch.testing.assert_close(g.double(), want_g, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(beta.double(), 1 / (1 + (-b.double()).exp()), atol=1e-6, rtol=1e-6)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_gated_rms_norm_equals_reference(dtype):
    """The one-kernel gated norm against the plain-PyTorch one: a float32 mixer output and a gate that is a
    strided slice of a merged projection (float32: within 1e-5). In float16 the same roundings (to the model's dtype before the
    weight, after it, at the end) give the same values: at least 97% of them bit for bit (a sum in another
    order may flip a rounding), where leaving the intermediate roundings out matches ~65%. (bfloat16 runs
    on the GPU, tests/test_gpu_phases.py: the interpreter's bfloat16 does not round to nearest.)"""
    from infer.kernels import gated_delta_triton as tri

    gen = torch.Generator().manual_seed(6)
    t, h, dv = 5, 3, 24
    x = torch.randn(t, h, dv, generator=gen) * 3
    merged = torch.randn(t, 7 + h * dv, generator=gen).to(dtype)
    gate = merged[:, 7:].view(t, h, dv)
    weight = (torch.rand(dv, generator=gen) + 0.5).to(dtype)
    out = tri.gated_rms_norm(x, gate, weight, 1e-6)
    ref = gdr.gated_rms_norm(x, gate, weight, 1e-6)
    assert out.dtype == dtype and out.is_contiguous()
    if dtype == torch.float16:
        assert (out == ref).float().mean() >= 0.97
    torch.testing.assert_close(out, ref, atol=1e-5 if dtype == torch.float32 else 5e-3, rtol=1e-3)


# ---------------------------------------------------------------------------------- the gated attention's fused steps


def _gated_qkv(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A merged projection's output ``[T, (2 Hq + 2 Hkv) D]`` (q and gate heads, k, v) as a row slice of a
    wider tensor (strided rows, as the fused forward may pass them)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, (2 * hq + 2 * hkv) * d + 8, generator=g) * 2).to(dtype)[:, 8:]


def _unfused_gated_attention_inputs(qkv, cos, sin, hq, hkv, d, r, qw, kw):
    """The model's unfused steps (GatedAttention._attend): rms_norm per head, apply_rope on the first r
    dimensions, the rest passed through; the tables in qkv's dtype, as that path has them."""
    from infer.models.layers import apply_rope, rms_norm

    t = qkv.shape[0]
    q = rms_norm(qkv[:, :hq * 2 * d].view(t, hq, 2 * d)[..., :d], qw, 1e-6, True)
    k = rms_norm(qkv[:, hq * 2 * d:hq * 2 * d + hkv * d].view(t, hkv, d), kw, 1e-6, True)
    qk = torch.cat((q, k), dim=1)
    qk = torch.cat((apply_rope(qk[..., :r], cos.to(qkv.dtype), sin.to(qkv.dtype)), qk[..., r:]), dim=-1)
    return qk[:, :hq], qk[:, hq:]


@pytest.mark.parametrize("ops", ["reference", pytest.param("triton", marks=interpreted)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_qk_norm_rope_and_output_gate(ops, dtype):
    """``gated_qk_norm_rope`` and ``sigmoid_gate_mul`` (the gated attention's steps around its attention, two
    launches on a GPU) against the model's unfused PyTorch steps: in float32 the same values bit for bit
    (the same float32 operations); in bfloat16 within the unfused path's own extra roundings (the tables
    and each product rounded to bfloat16 there): 2 ulps of the largest |x| that enters a rotation. The
    Triton kernels (interpreted) equal the reference bit for bit (the gate within an ulp of float32: its
    sigmoid). 4 query heads with their gates, 2 KV
    heads of 32, a partial rotation of 8 dimensions, positions up to 1,000; k rotated in place, v and the
    gate views of the input, untouched."""
    from infer.kernels import fused_reference, fused_triton
    from infer.models.layers import rope_cos_sin

    impl = fused_triton if ops == "triton" else fused_reference
    hq, hkv, d, r = 4, 2, 32, 8
    qkv = _gated_qkv(3, hq, hkv, d, dtype, seed=7)
    before = qkv.clone()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    cos, sin = rope_cos_sin(torch.tensor([0, 17, 1000]), inv_freq, torch.float32)
    g = torch.Generator().manual_seed(8)
    qw, kw = (torch.randn(d, generator=g) * 0.1).to(dtype), (torch.randn(d, generator=g) * 0.1).to(dtype)
    q_want, k_want = _unfused_gated_attention_inputs(before, cos, sin, hq, hkv, d, r, qw, kw)
    q, k, v, gate = impl.gated_qk_norm_rope(qkv, cos, sin, hq, hkv, d, r, qw, kw, 1e-6)
    assert q.shape == (3, hq, d) and q.is_contiguous() and k.shape == v.shape == (3, hkv, d)
    nq = hq * 2 * d
    assert torch.equal(k, qkv[:, nq:nq + hkv * d].view(3, hkv, d))  # k was rotated in place
    assert torch.equal(v, before[:, nq + hkv * d:].view(3, hkv, d))
    assert torch.equal(gate, before[:, :nq].view(3, hq, 2 * d)[..., d:])
    if dtype == torch.float32:
        assert torch.equal(q, q_want) and torch.equal(k, k_want)
    else:
        bound = 2 * 2.0 ** -8 * max(q_want.float().abs().max(), k_want.float().abs().max())
        assert (q.float() - q_want.float()).abs().max() <= bound and (k.float() - k_want.float()).abs().max() <= bound
    if ops == "triton":
        q_ref, k_ref, _, _ = fused_reference.gated_qk_norm_rope(before.clone(), cos, sin, hq, hkv, d, r, qw, kw, 1e-6)
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    o = (torch.randn(3, hq, d, generator=g) * 2).to(dtype)
    out = impl.sigmoid_gate_mul(o, gate)
    want = (o.float().reshape(3, -1) * torch.sigmoid(gate.float().reshape(3, -1))).to(dtype)
    assert out.shape == (3, hq * d)
    exact = ops == "reference"  # (Triton's sigmoid may differ from torch's by an ulp of float32)
    torch.testing.assert_close(out, want, atol=0 if exact else 1e-7,
                               rtol=0 if exact else 1e-6 if dtype == torch.float32 else 2.0 ** -8)
    with pytest.raises(ValueError, match="qkv must be"):
        impl.gated_qk_norm_rope(qkv[:, :-d], cos, sin, hq, hkv, d, r, qw, kw, 1e-6)
    with pytest.raises(ValueError, match="rotary_dim"):
        impl.gated_qk_norm_rope(qkv, cos, sin, hq, hkv, d, 7, qw, kw, 1e-6)
    with pytest.raises(ValueError, match="cos must be"):
        impl.gated_qk_norm_rope(qkv, cos.to(dtype) if dtype != torch.float32 else cos[:2], sin, hq, hkv, d, r, qw,
                                kw, 1e-6)


@pytest.mark.parametrize("ops", ["reference", pytest.param("triton", marks=interpreted)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["f32", "bf16", "fp8-cache"])
def test_gated_qk_norm_rope_writes_the_kv_cache(ops, dtype):
    """``gated_qk_norm_rope`` with ``kv_cache``: the rotated k and the v heads of each token stored at its slot, as
    ``reshape_and_cache`` stores the step's k and v (float32, bfloat16, and an FP8 cache of a bfloat16 model with
    per-layer scales); a padding token (slot -1) writes nothing; q, k and v are those of the call without the
    cache (the Triton kernel's cache bit for bit the reference's)."""
    from infer.kernels import fused_reference, fused_triton
    from infer.kernels.attention_reference import reshape_and_cache
    from infer.models.layers import rope_cos_sin

    impl = fused_triton if ops == "triton" else fused_reference
    fp8 = dtype == torch.float8_e4m3fn
    model_dtype = torch.bfloat16 if fp8 else dtype
    hq, hkv, d, r, blocks, bs = 4, 2, 32, 8, 3, 4
    qkv = _gated_qkv(3, hq, hkv, d, model_dtype, seed=9)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    cos, sin = rope_cos_sin(torch.tensor([5, 6, 40]), inv_freq, torch.float32)
    g = torch.Generator().manual_seed(10)
    qw, kw = (torch.randn(d, generator=g) * 0.1).to(model_dtype), (torch.randn(d, generator=g) * 0.1).to(model_dtype)
    slots = torch.tensor([5, -1, 10])
    cache = [torch.zeros(blocks, bs, hkv, d, dtype=dtype) for _ in range(2)]
    scales = (torch.tensor([0.05]), torch.tensor([0.07])) if fp8 else None
    plain = impl.gated_qk_norm_rope(qkv.clone(), cos, sin, hq, hkv, d, r, qw, kw, 1e-6)
    got = impl.gated_qk_norm_rope(qkv, cos, sin, hq, hkv, d, r, qw, kw, 1e-6, kv_cache=cache, slot_mapping=slots,
                                  kv_scales=scales)
    for a, b in zip(got, plain):
        assert torch.equal(a, b)
    want = [torch.zeros_like(c) for c in cache]
    reshape_and_cache(plain[1], plain[2], *want, slots, *(scales or (None, None)))
    for c, w in zip(cache, want):
        assert torch.equal(c.view(torch.uint8), w.view(torch.uint8))
    written = [5, 10]
    rest = [i for i in range(blocks * bs) if i not in written]
    assert not any(c.view(blocks * bs, -1)[rest].view(torch.uint8).any() for c in cache)
    assert all(c.view(blocks * bs, -1)[written].view(torch.uint8).any() for c in cache)
