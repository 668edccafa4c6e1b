"""The recurrent-state cache of hybrid models (phase 17): one slot per running sequence.

A linear-attention layer (Gated DeltaNet) does not keep a key and a value per token: everything a
sequence has seen is folded into a fixed-size state, whatever its length. Each slot holds, for every
linear-attention layer,

* the *conv state*: the last ``K - 1`` inputs of the short causal convolution (``[C, K - 1]``,
  ``C`` = the q, k and v channels), in the model dtype;
* the *SSM state*: the delta rule's matrix ``S`` per value head (``[Hv, Dk, Dv]``), in float32 (or bfloat16:
  ``EngineConfig.ssm_state_dtype``, vLLM's ``mamba_ssm_cache_dtype``; the kernels compute in float32).

Which slot a sequence owns is decided by the scheduler's
:class:`~infer.engine.kv_cache_manager.KVCacheManager` (taken at admission, given back at finish,
abort or preemption), exactly like its KV blocks; this class only holds the tensors. vLLM's Mamba
cache and SGLang's ``MambaPool`` are the same idea.
"""

from __future__ import annotations

import torch


class RecurrentStateCache:
    """``num_slots`` sequence slots of conv and SSM state for ``num_layers`` linear-attention layers.

    Storage: ``conv [num_layers, num_slots, conv_dim, kernel - 1]`` in ``dtype`` and
    ``ssm [num_layers, num_slots, num_v_heads, key_head_dim, value_head_dim]`` in ``ssm_dtype`` (float32 by
    default), zeroed.
    A slot's content is garbage until its sequence's first step writes it: the layers read a slot
    only for a sequence whose first new position is past 0 (:meth:`AttentionMetadata.first_positions`).

    ``pad_slot=True`` adds one slot past the ``num_slots`` sequence slots, :attr:`pad_slot`, that no
    sequence ever owns: the padding rows of a CUDA graph's decode bucket read and write it
    (:class:`~infer.engine.cuda_graphs.CUDAGraphRunner`), so a replay of 4 rows for 3 sequences
    updates some state without touching a real one (vLLM pads its Mamba state indices the same way).
    """

    def __init__(self, num_layers: int, num_slots: int, conv_dim: int, kernel: int, num_v_heads: int,
                 key_head_dim: int, value_head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 pad_slot: bool = False, ssm_dtype: torch.dtype = torch.float32) -> None:
        rows = num_slots + int(pad_slot)
        self.conv = torch.zeros(num_layers, rows, conv_dim, kernel - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(num_layers, rows, num_v_heads, key_head_dim, value_head_dim, dtype=ssm_dtype,
                               device=device)
        self.num_slots = num_slots  # the sequence slots (the scheduler hands out 0 .. num_slots - 1)
        self.pad_slot: int | None = num_slots if pad_slot else None

    @classmethod
    def for_model(cls, cfg, num_slots: int, dtype: torch.dtype, device, pad_slot: bool = False,
                  ssm_dtype: torch.dtype = torch.float32) -> RecurrentStateCache:
        """The cache of a :class:`~infer.config.ModelConfig` with linear-attention layers."""
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
            cfg.linear_num_value_heads * cfg.linear_value_head_dim
        return cls(cfg.num_layers - cfg.num_kv_layers, num_slots, conv_dim, cfg.linear_conv_kernel_dim,
                   cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, dtype, device,
                   pad_slot=pad_slot, ssm_dtype=ssm_dtype)

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * self.ssm.element_size()

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot, across all linear-attention layers."""
        return self.nbytes // self.conv.shape[1]

    def copy_slot(self, src: int | torch.Tensor, dst: int | torch.Tensor) -> None:
        """Copy slot ``src`` into ``dst`` in every layer (``n > 1``: each fork starts from the state its
        shared prompt left), or slots ``src[i]`` into ``dst[i]`` (int64 ``[N]`` device tensors, the ``dst``
        distinct from each other and from every ``src``: a decode step's state snapshots after its CUDA graph)."""
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]
