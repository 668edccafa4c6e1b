"""The speculative-sampling acceptance rule (Leviathan et al., "Fast Inference from Transformers via
Speculative Decoding", arXiv:2211.17192; Chen et al., "Accelerating Large Language Model Decoding with
Speculative Sampling", arXiv:2302.01318), in plain PyTorch.

A proposer drafted ``x_1 .. x_k``, drawing ``x_i`` from ``q_i`` (its distribution after ``x_1 .. x_{i-1}``);
the target's distributions at the same positions are ``p_1 .. p_{k+1}``. For ``i = 1, 2, ...``:

* accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``;
* on the first rejection emit a token drawn from ``norm(max(0, p_i - q_i))`` and stop;
* when all ``k`` are accepted, emit a *bonus* token drawn from ``p_{k+1}``.

Each emitted token is distributed exactly as the target's ``p`` at its position. Proof sketch for one
position: ``P(emit v) = q(v) min(1, p(v)/q(v)) + (1 - sum_u min(q(u), p(u))) * max(0, p(v) - q(v)) / Z``
with ``Z = sum_u max(0, p(u) - q(u)) = 1 - sum_u min(p(u), q(u))``; the first term is ``min(p(v), q(v))``,
the second ``max(0, p(v) - q(v))``, and they add up to ``p(v)``.

With a point mass ``q = 1[x]`` (a proposer that drafts greedily, as infer's n-gram and draft proposers
do) the rule accepts ``x`` with probability ``p(x)`` and otherwise samples ``p`` with ``x`` removed,
renormalized: the same as drawing ``y ~ p`` and accepting when ``y == x``, which is what the engine does
with its regular sampler (:mod:`infer.engine.spec_decode`). :func:`rejection_sample` is the general rule,
the reference the tests check both against.
"""

from __future__ import annotations

import torch

__all__ = ["rejection_sample"]


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify ``B`` sequences' drafts by the rule of the module docstring.

    Args:
        target_probs: ``[B, k + 1, V]`` float, the target's distribution at each drafted position and the
            one after the last (rows sum to 1; every sampling parameter already applied).
        draft_token_ids: ``[B, k]`` int64, the drafts.
        draft_probs: ``[B, k, V]`` float, the distributions they were drawn from, or ``None`` for point
            masses (a greedy proposer: ``q_i = 1[x_i]``).
        generator: the random stream (``None``: PyTorch's default).

    Returns:
        ``(output [B, k + 1] int64, num_accepted [B] int64)``: row ``b`` emits ``output[b, :num_accepted[b] + 1]``
        (the accepted drafts, then the token drawn from the residual or the bonus token); the entries
        after it are -1.

    Raises:
        ValueError: for shapes that do not agree.
    """
    b, k1, v = target_probs.shape
    k = k1 - 1
    if draft_token_ids.shape != (b, k) or (draft_probs is not None and draft_probs.shape != (b, k, v)):
        raise ValueError(f"target_probs {tuple(target_probs.shape)} needs draft_token_ids [{b}, {k}] and draft_probs "
                         f"[{b}, {k}, {v}], got {tuple(draft_token_ids.shape)} and "
                         f"{None if draft_probs is None else tuple(draft_probs.shape)}")
    p = target_probs.double()
    q = (torch.nn.functional.one_hot(draft_token_ids, v).double() if draft_probs is None
         else draft_probs.double())
    x = draft_token_ids
    p_x = p[:, :k].gather(2, x[..., None])[..., 0]  # [B, k]
    q_x = q.gather(2, x[..., None])[..., 0]
    u = torch.rand(b, k, generator=generator, dtype=torch.float64, device=p.device)
    # >>> EXERCISE rejection_rule
    accept = u * q_x < p_x  # u < p/q, without dividing by a zero q (then x could not have been drafted)
    # the leading run of acceptances
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]
    # the distribution of the token after the run: the residual at the rejected position, or p_{k+1}
    residual = torch.clamp(p[:, :k] - q, min=0.0)
    residual = torch.cat([residual, p[:, k:]], dim=1)  # [B, k + 1, V]: position k is the bonus
    at = num_accepted[:, None, None].expand(b, 1, v)
    last = residual.gather(1, at)[:, 0]  # [B, V]
    total = last.sum(dim=1, keepdim=True)
    # p == q exactly at a rejected position cannot happen (acceptance is certain there); guard anyway
    last = torch.where(total > 0, last / total.clamp(min=1e-300), p.gather(1, at)[:, 0])
    # <<< EXERCISE rejection_rule
    extra = torch.multinomial(last.float(), 1, generator=generator)[:, 0]
    out = torch.full((b, k1), -1, dtype=torch.int64, device=p.device)
    pos = torch.arange(k1, device=p.device)[None, :]
    out[:, :k] = torch.where(pos[:, :k] < num_accepted[:, None], x, -1)
    out.scatter_(1, num_accepted[:, None], extra[:, None])
    return out, num_accepted
