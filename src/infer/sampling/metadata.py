"""The batch's sampling parameters as device tensors: :class:`SamplingTensors` and how it is built.

Every row of a batch is a sequence with its own :class:`~infer.sampling.SamplingParams`. The
sampler (:mod:`infer.sampling.sampler`) must not loop over rows nor read the device, so once per
step :meth:`SamplingTensors.from_params` turns the B requests' parameters into ``[B]`` tensors
(temperature, top-k, top-p, min-p, the penalties, each row's seed and step of its random stream),
their token histories into ``-1``-padded ``[B, L]`` tensors, and decides on the host what only
the host can decide cheaply: which transforms some row needs at all (the ``do_*`` flags), how
many top logprobs to return, whether the Triton kernels run. vLLM keeps the same object
(``SamplingMetadata`` in ``vllm/v1/sample/metadata.py``; vLLM v0's was even called
``SamplingTensors``), SGLang its ``SamplingBatchInfo``.

Building it is host work on the engine's critical path, every step, so it is done in NumPy and
moved to the device in as few copies as possible (:func:`_to_device_async`, pinned memory):

* :func:`_check_inputs`: the lists' lengths, and where :func:`~infer.sampling.sampler.sample` runs;
* :func:`_distinct_params`: one row of values per distinct :class:`SamplingParams` object;
* :func:`_token_lists`: the token histories (only for the rows with a penalty) and banned ids;
* :func:`_row_seeds`: each row's seed;
* :func:`_pack_parameters`: the nine ``[B]`` parameters in one buffer, one host-to-device copy.

Sibling modules: :mod:`infer.sampling.logits_processors` (what the parameters do),
:mod:`infer.sampling.rng` (what the seeds and steps index), :mod:`infer.sampling.sampler` (which
reads the flags to skip the steps no row needs).
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from infer.sampling.params import SamplingParams
from infer.sampling.rng import _signed64

__all__ = ["SamplingTensors", "triton_usable"]


def triton_usable(device: torch.device | str) -> bool:
    """Whether the sampler's Triton kernels can run on ``device``: Triton is installed, and the
    device is CUDA or the CPU interpreter is on (``TRITON_INTERPRET=1``). Triton is imported only
    when the kernels run, so this module works where Triton is not installed."""
    on_device = torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return on_device and importlib.util.find_spec("triton") is not None


def _pad(rows: Sequence[Sequence[int]], vocab_size: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Ragged lists of ids -> (``[B, max_len]`` int64 padded with -1, ``[B]`` lengths), on the host.

    Raises:
        ValueError: an id is outside ``[0, vocab_size)`` (the message names ``name[row]``).
    """
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    width = int(lengths.max(initial=0))
    padded = np.full((len(rows), width), -1, dtype=np.int64)
    if width:
        for i, r in enumerate(rows):
            if lengths[i]:
                padded[i, : lengths[i]] = r
        real = np.arange(width)[None, :] < lengths[:, None]
        bad = real & ((padded < 0) | (padded >= vocab_size))
        if bad.any():
            i = int(bad.any(axis=1).argmax())
            raise ValueError(f"{name}[{i}] has token ids outside [0, {vocab_size}): {padded[i][bad[i]][:5].tolist()}")
    return padded, lengths


def _to_device(padded: np.ndarray, lengths: np.ndarray, keep: np.ndarray | None, device) -> torch.Tensor:
    """The rows of ``padded`` where ``keep`` (all if ``None``), others emptied, trimmed, on ``device``."""
    if keep is not None:
        padded[~keep] = -1
        lengths = np.where(keep, lengths, 0)
    width = int(lengths.max(initial=0))
    return _to_device_async(np.ascontiguousarray(padded[:, :width]), device)


def _to_device_async(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A fresh host array as a tensor on ``device``, without blocking the host on a GPU.

    A copy from pageable memory makes the host wait for the GPU's queued work; from pinned
    memory (PyTorch's caching host allocator, which keeps the block until the copy is done) it
    is queued behind that work and the host moves on.
    """
    host = torch.from_numpy(array)
    if not array.size:  # nothing to copy (a zero-width history)
        return torch.empty(array.shape, dtype=host.dtype, device=device)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class SamplingTensors:
    """The sampling parameters of a batch, one row per sequence, as device tensors.

    Build it with :meth:`from_params`; building it by hand is fine too (the shapes and dtypes
    are checked, the values are not). The host flags let :func:`sample` skip work that no row
    needs; their defaults (``do_* = True``, ``any_greedy = True``, ``max_top_k = 0``,
    ``top_p_rows = None``) are always correct, since a row whose parameter disables a transform
    passes through it unchanged.

    Attributes:
        temperature: ``[B]`` float32, >= 0 (0 = greedy).
        top_k: ``[B]`` int64, >= 1; the vocabulary size means "disabled".
        top_p: ``[B]`` float32 in (0, 1].
        min_p: ``[B]`` float32 in [0, 1].
        repetition_penalty: ``[B]`` float32, > 0.
        presence_penalty: ``[B]`` float32.
        frequency_penalty: ``[B]`` float32.
        seeds: ``[B]`` int64, each request's seed.
        steps: ``[B]`` int64, how many tokens the request has sampled so far (its position in
            its random stream).
        prompt_ids: ``[B, Lp]`` int64, prompt tokens for the repetition penalty, -1 padded.
        output_ids: ``[B, Lo]`` int64, generated tokens for all penalties, -1 padded.
        suppress_ids: ``[B, S]`` int64, ids banned this step (min_tokens), -1 padded.
        max_num_logprobs: host int, the largest ``logprobs`` (top-N) asked for in the batch.
        all_greedy: host bool, every row has ``temperature == 0``.
        do_penalties, do_min_p, do_top_k, do_top_p: host bools, some row needs the transform.
        any_greedy: host bool, some row has ``temperature == 0``.
        max_top_k: host int, the largest ``top_k`` among the rows that truncate with it (top-k
            then needs ``torch.topk`` to that k, not a sort); 0 means "unknown: sort".
        top_p_rows: ``[R]`` int64, the rows that need top-p, or ``None`` for "every row".
        top_p_in_top_k: host bool, every row that needs top-p also has a top-k (its nucleus is
            among the ``max_top_k`` largest logits: no sort of the vocabulary).
        use_triton: host bool, :func:`sample` runs the Triton kernels (CUDA tensors, or CPU
            tensors under ``TRITON_INTERPRET=1``) instead of the plain-PyTorch path.
        token_bitmask: ``[R, ceil(V / 32)]`` int32 or ``None``: the allowed tokens of the ``R``
            constrained rows (structured output, phase 13; bit ``v % 32`` of word ``v // 32``).
        token_bitmask_rows: ``[R]`` int64, the row each mask applies to (``None`` with no mask).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor
    prompt_ids: torch.Tensor
    output_ids: torch.Tensor
    suppress_ids: torch.Tensor
    max_num_logprobs: int = 0
    all_greedy: bool = False
    do_penalties: bool = True
    do_min_p: bool = True
    do_top_k: bool = True
    do_top_p: bool = True
    any_greedy: bool = True
    max_top_k: int = 0
    top_p_rows: torch.Tensor | None = None
    top_p_in_top_k: bool = False
    use_triton: bool = False
    token_bitmask: torch.Tensor | None = None
    token_bitmask_rows: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b = self.temperature.shape[0] if self.temperature.dim() == 1 else -1
        one_d = {
            "temperature": torch.float32,
            "top_k": torch.int64,
            "top_p": torch.float32,
            "min_p": torch.float32,
            "repetition_penalty": torch.float32,
            "presence_penalty": torch.float32,
            "frequency_penalty": torch.float32,
            "seeds": torch.int64,
            "steps": torch.int64,
        }
        for name, dtype in one_d.items():
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != b or t.dtype != dtype:
                raise ValueError(
                    f"SamplingTensors.{name} must be a [B] {dtype} tensor with B = "
                    f"{b}, got shape {tuple(t.shape)} {t.dtype}"
                )
        for name in ("prompt_ids", "output_ids", "suppress_ids"):
            t = getattr(self, name)
            if t.dim() != 2 or t.shape[0] != b or t.dtype != torch.int64:
                raise ValueError(
                    f"SamplingTensors.{name} must be a [B, L] int64 tensor with B = {b}, "
                    f"got shape {tuple(t.shape)} {t.dtype}"
                )
        if not isinstance(self.max_num_logprobs, int) or self.max_num_logprobs < 0:
            raise ValueError(f"max_num_logprobs must be an int >= 0, got {self.max_num_logprobs!r}")
        if not isinstance(self.max_top_k, int) or self.max_top_k < 0:
            raise ValueError(f"max_top_k must be an int >= 0, got {self.max_top_k!r}")
        if self.top_p_rows is not None and (self.top_p_rows.dim() != 1 or self.top_p_rows.dtype != torch.int64):
            raise ValueError(
                f"SamplingTensors.top_p_rows must be None or a [R] int64 tensor, got "
                f"{tuple(self.top_p_rows.shape)} {self.top_p_rows.dtype}"
            )

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @property
    def greedy_fast_path(self) -> bool:
        """Every row is greedy and nothing edits the logits first: :func:`sample` is an argmax."""
        return self.all_greedy and not self.do_penalties and self.suppress_ids.shape[1] == 0

    @classmethod
    def from_params(
        cls,
        params_list: Sequence[SamplingParams],
        seeds: Sequence[int | None] | None,
        steps: Sequence[int] | None,
        prompt_ids_list: Sequence[Sequence[int]] | None,
        output_ids_list: Sequence[Sequence[int]] | None,
        suppress_list: Sequence[Sequence[int]] | None,
        vocab_size: int,
        device: torch.device | str = "cpu",
        use_triton: bool | None = None,
    ) -> SamplingTensors:
        """Build the batch on the host (NumPy), then move it to ``device`` in one copy.

        The nine ``[B]`` parameters travel in one packed buffer (one host-to-device copy; the
        tensors are views of it), and the token histories in one copy each, only when some row
        needs them. Rows that share one :class:`SamplingParams` object (an ``LLM.generate``
        call's prompts) are read once.

        Args:
            params_list: B :class:`SamplingParams`, one per row (sequence).
            seeds: B seeds, or ``None``. Row ``i`` uses ``seeds[i]``, else
                ``params_list[i].seed``, else a fresh random seed (not reproducible). The
                engine should fix each sequence's seed once and pass it at every step (and
                give the ``n`` sequences of one request different seeds).
            steps: B stream positions, or ``None`` for ``len(output_ids_list[i])`` (0 without
                outputs).
            prompt_ids_list: B prompt token lists (used by the repetition penalty), or ``None``.
            output_ids_list: B generated-token lists (used by every penalty), or ``None``.
            suppress_list: B lists of ids to ban this step, or ``None``. The engine passes
                EOS + ``stop_token_ids`` for rows that have not reached ``min_tokens``.
            vocab_size: V, the width of the logits.
            device: where the tensors live.
            use_triton: run :func:`sample`'s Triton kernels; ``None`` picks them on a CUDA
                device (``True`` on a CPU device needs ``TRITON_INTERPRET=1``).

        Raises:
            ValueError: a list's length is not B, a token id is outside ``[0, V)``, or
                ``use_triton=True`` where Triton cannot run.
        """
        batch = len(params_list)
        use_triton = _check_inputs(batch, vocab_size, device, use_triton, seeds=seeds, steps=steps,
                                   prompt_ids_list=prompt_ids_list, output_ids_list=output_ids_list,
                                   suppress_list=suppress_list)
        uniq_table, row_of = _distinct_params(params_list, vocab_size)
        temp_u, top_p_u, min_p_u, rep_u, pres_u, freq_u, top_k_u, logprobs_u = uniq_table.T
        # what each distinct params object needs (greedy rows ignore temperature and truncation)
        sampled_u = temp_u != 0.0
        top_k_on = sampled_u & (top_k_u < vocab_size)
        top_p_on = sampled_u & (top_p_u < 1.0)
        rep = rep_u != 1.0
        pen = rep | (pres_u != 0.0) | (freq_u != 0.0)
        do_penalties = bool(pen.any())

        # the histories are kept for the rows with a penalty only (the prompt: a repetition penalty)
        keep = (rep[row_of], pen[row_of]) if do_penalties else None
        prompt_ids, output_ids, suppress_ids, output_len = _token_lists(
            prompt_ids_list, output_ids_list, suppress_list, batch, vocab_size, keep, device
        )
        row_seeds = _row_seeds(seeds, params_list)
        if steps is not None:
            row_steps = np.asarray(steps, dtype=np.int64)
        else:
            row_steps = output_len
        f32, i64 = _pack_parameters(uniq_table, row_of, row_seeds, row_steps, device)

        top_p_rows = None
        if top_p_on.any():
            need = np.flatnonzero(top_p_on[row_of])
            if len(need) < batch:
                top_p_rows = _to_device_async(need.astype(np.int64), device)

        return cls(
            temperature=f32[0],
            top_p=f32[1],
            min_p=f32[2],
            repetition_penalty=f32[3],
            presence_penalty=f32[4],
            frequency_penalty=f32[5],
            top_k=i64[0],
            seeds=i64[1],
            steps=i64[2],
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            suppress_ids=suppress_ids,
            max_num_logprobs=int(logprobs_u.max(initial=0)),
            all_greedy=not sampled_u.any(),
            do_penalties=do_penalties,
            do_min_p=bool((sampled_u & (min_p_u > 0.0)).any()),
            do_top_k=bool(top_k_on.any()),
            do_top_p=bool(top_p_on.any()),
            any_greedy=not sampled_u.all(),
            max_top_k=int(top_k_u[top_k_on].max(initial=0)),
            top_p_rows=top_p_rows,
            top_p_in_top_k=bool((top_k_on | ~top_p_on).all()),
            use_triton=bool(use_triton),
        )


# ----------------------------------------------------------------------------- from_params, step by step


def _check_inputs(batch: int, vocab_size: int, device: torch.device | str, use_triton: bool | None,
                  **lists: Sequence | None) -> bool:
    """Check the vocabulary size and that every list given has one entry per row; return whether
    :func:`~infer.sampling.sampler.sample` runs the Triton kernels (``use_triton``, or ``None``:
    on a CUDA device where Triton is installed).

    Raises:
        ValueError: ``vocab_size < 1``, a list's length is not ``batch``, or ``use_triton=True``
            where Triton cannot run.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    for name, lst in lists.items():
        if lst is not None and len(lst) != batch:
            raise ValueError(f"{name} has {len(lst)} entries, expected one per row ({batch})")
    if use_triton is None:
        return torch.device(device).type == "cuda" and triton_usable(device)
    if use_triton and not triton_usable(device):
        raise ValueError(
            f"use_triton=True on {device} needs Triton and a CUDA device, or TRITON_INTERPRET=1 set before "
            "triton is imported"
        )
    return use_triton


def _distinct_params(params_list: Sequence[SamplingParams], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """One row of values per distinct params object, and the row each sequence reads.

    The prompts of one ``LLM.generate`` call share one :class:`SamplingParams` object: its values
    are read once, and each sequence gathers them (the per-row Python work is a few C-level maps).

    Returns:
        ``(table, row_of)``: ``[U, 8]`` float64, the columns temperature, top_p, min_p,
        repetition_penalty, presence_penalty, frequency_penalty, top_k (``V`` when disabled) and
        logprobs (0 for ``None``) of the ``U`` distinct objects; ``[B]`` int64, each sequence's row.
    """
    keys = list(map(id, params_list))
    distinct = dict(zip(keys, params_list))
    position = {key: i for i, key in enumerate(distinct)}
    uniq = list(distinct.values())
    uniq_table = np.array(
        [
            (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
             p.top_k if 0 < p.top_k < vocab_size else vocab_size, p.logprobs or 0)
            for p in uniq
        ],
        dtype=np.float64,
    ).reshape(len(uniq), 8)
    row_of = np.fromiter(map(position.__getitem__, keys), dtype=np.int64, count=len(keys))
    return uniq_table, row_of


def _token_lists(
    prompt_ids_list: Sequence[Sequence[int]] | None,
    output_ids_list: Sequence[Sequence[int]] | None,
    suppress_list: Sequence[Sequence[int]] | None,
    batch: int,
    vocab_size: int,
    keep: tuple[np.ndarray, np.ndarray] | None,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
    """The prompt, output and suppressed ids on ``device``, each ``[B, L]`` int64 padded with -1.

    Every list given is validated (a list not given is B empty rows). The histories are needed by
    the rows with a penalty only: ``keep`` is ``(prompt rows, output rows)``, ``[B]`` bools, and the
    other rows get an empty (all -1) row, which is equivalent and keeps the padded width small;
    ``keep=None`` (no penalty in the batch) sends ``[B, 0]`` histories.

    Returns:
        ``(prompt_ids, output_ids, suppress_ids, output_len)``, ``output_len`` the ``[B]`` int64
        lengths of the output lists on the host (zeros without them).

    Raises:
        ValueError: a token id outside ``[0, vocab_size)``.
    """
    none = np.zeros((batch, 0), dtype=np.int64), np.zeros(batch, dtype=np.int64)
    prompt_np, prompt_len = none if prompt_ids_list is None else _pad(prompt_ids_list, vocab_size,
                                                                      "prompt_ids_list")
    output_np, output_len = none if output_ids_list is None else _pad(output_ids_list, vocab_size,
                                                                      "output_ids_list")
    suppress_np, suppress_len = none if suppress_list is None else _pad(suppress_list, vocab_size,
                                                                        "suppress_list")
    if keep is not None:
        keep_prompt, keep_output = keep
        prompt_ids = _to_device(prompt_np, prompt_len, keep_prompt, device)
        output_ids = _to_device(output_np, output_len, keep_output, device)
    else:
        prompt_ids = output_ids = torch.empty(batch, 0, dtype=torch.int64, device=device)
    return prompt_ids, output_ids, _to_device(suppress_np, suppress_len, None, device), output_len


def _row_seeds(seeds: Sequence[int | None] | None, params_list: Sequence[SamplingParams]) -> np.ndarray:
    """``[B]`` int64: ``seeds[i]``, else ``params_list[i].seed``, else a fresh random seed, each
    reduced into int64's range."""
    batch = len(params_list)
    try:  # the engine passes one int64 seed per row: one C-level conversion
        row_seeds = np.asarray(seeds, dtype=np.int64) if seeds is not None else None
    except (TypeError, OverflowError, ValueError):
        row_seeds = None
    if row_seeds is None or row_seeds.shape != (batch,):
        row_seeds = np.empty(batch, dtype=np.int64)
        for i, p in enumerate(params_list):
            s = seeds[i] if seeds is not None else None
            if s is None:
                s = p.seed if p.seed is not None else random.getrandbits(64)
            row_seeds[i] = _signed64(int(s))
    return row_seeds


def _pack_parameters(uniq_table: np.ndarray, row_of: np.ndarray, row_seeds: np.ndarray, row_steps: np.ndarray,
                     device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The nine ``[B]`` parameters in one buffer, moved to ``device`` in one host-to-device copy.

    Returns:
        ``(f32, i64)``, views of that one device buffer: ``[6, B]`` float32 (temperature, top_p,
        min_p, repetition, presence and frequency penalties) and ``[3, B]`` int64 (top_k, seeds,
        steps).
    """
    batch = len(row_of)
    # 6 float32 rows, then 3 int64 rows
    nf = 6 * batch * 4
    buf = np.empty(nf + 3 * batch * 8, dtype=np.uint8)
    floats = buf[:nf].view(np.float32).reshape(6, batch)
    ints = buf[nf:].view(np.int64).reshape(3, batch)
    if batch:
        table = uniq_table[row_of]  # [B, 8]
        floats[:] = table[:, :6].T
        ints[0] = table[:, 6]
    ints[1] = row_seeds
    ints[2] = row_steps
    if batch:
        packed = _to_device_async(buf, device)  # the one host-to-device copy
        f32 = packed[:nf].view(torch.float32).view(6, batch)
        i64 = packed[nf:].view(torch.int64).view(3, batch)
    else:
        f32 = torch.empty(6, 0, dtype=torch.float32, device=device)
        i64 = torch.empty(3, 0, dtype=torch.int64, device=device)
    return f32, i64
