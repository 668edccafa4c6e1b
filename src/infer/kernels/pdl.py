"""Programmatic dependent launch (PDL) for the decode path's Triton kernels (``EngineConfig.pdl``).

Kernels on one CUDA stream run one after the other: kernel N + 1 starts only once every program of
kernel N has finished and its writes are visible. Between the two the GPU pays a fixed cost (the
launch, the first wave of programs being placed on the SMs, the first loads' DRAM latency: a few
microseconds), which at batch-1 decode, where a layer is ~10 kernels of 3-30 us each, is a large share
of the step. Hopper (compute capability 9.0) lets a kernel launched with the *programmatic stream
serialization* attribute start early (CUDA's "programmatic dependent launch"; PTX ``griddepcontrol``):

* ``griddepcontrol.launch_dependents`` in kernel N says "the next kernel may start now"; it starts
  once every program of N has said it (or exited), in whatever SM room is left;
* ``griddepcontrol.wait`` in kernel N + 1 blocks until kernel N has *completed* and its memory is
  visible. Whatever N + 1 does before the wait must not read what N writes, nor write what N reads.

So a kernel launched this way does its independent work first, waits, and then the rest. For a
projection at batch 1 the independent work is most of it: the weights are never written, so the first
tile of the weight matrix is loaded before the wait and the load overlaps the previous kernel's tail
(:mod:`infer.kernels.skinny_gemm`); the decode attention reads the sequence's length (written by the host
only), plans its split and lets its unused programs exit before the wait
(:mod:`infer.kernels.decode_attention`); the QK norm + RoPE loads the token's position, cache slot, cos/sin
row and norm weights before it, and the RMSNorm kernels their weight (:mod:`infer.kernels.fused_triton`);
the activation kernel just waits at its start and gains the overlap of its launch. TensorRT-LLM,
FlashInfer and SGLang's kernels use the same two instructions; CUTLASS's example 63 prefetches weights the
same way. Inside a CUDA graph the attribute is recorded as a programmatic edge, so replays keep the
overlap.

The rule every kernel here follows: with ``USE_PDL`` it calls :func:`wait_for_previous` before its
first load of anything another kernel writes, and before its first store. A kernel that is not
launched with the attribute is serialized as usual, and the wait is then a no-op; a kernel after
one that never signals starts when it ends, as without PDL.

A consequence of waiting first: kernel N + 2 cannot launch before kernel N + 1 has waited for kernel N,
i.e. before N has completed. Where a small kernel sits between two large ones, the second large one then
starts placing its programs and fetching its first weights only once the first has finished. The norm
before the MLP's gate/up therefore uses :func:`launch_next_then_wait` instead (let the next kernel launch,
then wait): gate/up's programs are placed while the o projection still runs. Measured on an H200 (GPU
batch 1, ms per token): Qwen3-4B 2.625-2.627 -> 2.600, Qwen3-0.6B 0.863-0.864 -> 0.848-0.849. The
same for the norm before QKV was slower (2.70), and running every kernel that way had been too.

:func:`scope` turns it on for the kernels launched inside it (the model runner wraps every forward in
it when the flag is set), :func:`launch_options` is what the kernel wrappers pass to a launch. It
needs a CUDA device of compute capability 9.0 or later (``EngineConfig.validate`` checks); the interpreter
(``TRITON_INTERPRET=1``) never uses it.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import triton
import triton.language as tl

from infer.kernels.triton_common import INTERPRET

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("infer_pdl", default=False)


@contextlib.contextmanager
def scope(enabled: bool = True):
    """Launch the Triton kernels of :mod:`infer.kernels` with PDL (``enabled``) or without, inside.

    Per thread (a :class:`contextvars.ContextVar`): an engine's forwards and graph captures run on its
    own thread, so two engines in one process do not see each other's setting."""
    token = _ON.set(enabled)
    try:
        yield
    finally:
        _ON.reset(token)


def launch_pdl(x: torch.Tensor) -> bool:
    """Should a kernel over ``x`` be launched with PDL here: inside an enabled :func:`scope`, on a
    CUDA tensor, not under the interpreter."""
    return _ON.get() and x.is_cuda and not INTERPRET


def launch_options(x: torch.Tensor) -> dict:
    """The launch keywords of a kernel over ``x`` that follows the rule above: its ``USE_PDL`` constexpr
    and Triton's ``launch_pdl``, on (:func:`launch_pdl`) or off together."""
    on = launch_pdl(x)
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """With ``USE_PDL``: wait until the previous kernel on the stream has completed (its writes visible),
    then let the next one start launching. A no-op otherwise."""
    # >>> EXERCISE pdl_wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # <<< EXERCISE pdl_wait


@triton.jit
def launch_next_then_wait(USE_PDL: tl.constexpr):
    """:func:`wait_for_previous` in the other order: let the next kernel start launching at once, then
    wait for the previous one. For a small kernel between two large ones: the next kernel's programs are
    placed, and load what no kernel writes, while the kernel before this one still runs, instead of
    only once it has completed (this kernel cannot let them go before its own wait otherwise). Safe: the
    next kernel's wait still waits for this one to complete, and this one completes after its own wait."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
