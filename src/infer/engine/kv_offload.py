"""KV offload (phase 10): tiers of KV-cache blocks below the device's KV cache.

The prefix cache (phase 7) keeps the KV of finished requests' full blocks in the device's KV
cache, keyed by a hash of the block's tokens and of everything before it, until a new request
needs the memory; then the least recently used cached block is reused and its KV is lost. With
``EngineConfig.kv_offload`` such a block is first copied one tier down:

* the **host tier** (:class:`HostTier`): a pool of block-sized buffers in host memory (pinned on
  CUDA, so that copies to and from the GPU are asynchronous DMA), with its own LRU;
* the **disk tier** (:class:`DiskTier`, ``kv_offload="disk"``): a memory-mapped file of
  block-sized slots below the host tier; a block the host tier evicts is written there by a
  background thread, so the engine thread never waits for the disk.

A prefix lookup searches the device, then the host, then the disk (:func:`tiered_lookup`); a
block found below the device is copied back into a freshly allocated device block before the
request's first step (:meth:`KVOffloader.restore`). Every tier is bounded and evicts its least
recently used block when full, so a full tier never fails a request (the traps LMCache hit in
issues #1330 and #2106).

The copies (:class:`BlockCopier`) move one block across all layers at a time. With the
block-major cache (:class:`~infer.attention.KVCache` ``block_major=True``, used with the
Triton backend) that is one contiguous copy of ``2 * num_layers * block_size * num_kv_heads *
head_dim`` elements; otherwise it is a strided gather of ``2 * num_layers`` pieces. On CUDA they
run on a side stream ordered against the compute stream by events: a copy to the host waits for
the kernels that wrote the block and the compute stream waits for the copy before any kernel may
overwrite the block; a copy up waits for what the compute stream enqueued before it and the
compute stream waits for it before the step that reads the block (vLLM issue #45704 is what
happens without those waits: silently corrupted KV). Ideas from vLLM's offloading connector
(``vllm/v1/kv_offload``), LMCache and SGLang's HiCache.
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from infer.attention.kv_cache import KVCache

TIERS = ("device", "host", "disk")


def block_shape(kv: KVCache) -> tuple[int, ...]:
    """Shape of one block across all layers, K then V: ``[2, num_layers, block_size, num_kv_heads, head_dim]``."""
    num_layers, _, block_size, heads, head_dim = kv.k.shape
    return (2, num_layers, block_size, heads, head_dim)


def block_nbytes(kv: KVCache) -> int:
    """Bytes of one block across all layers (K and V)."""
    return math.prod(block_shape(kv)) * kv.k.element_size()


# ---------------------------------------------------------------------------------------- copies


class BlockCopier:
    """Copies whole blocks (every layer's K and V) between a :class:`KVCache` and host buffers.

    A host buffer is a ``[2, num_layers, block_size, num_kv_heads, head_dim]`` tensor of the
    cache's dtype (:func:`block_shape`). On the CPU a copy is done when the call returns. On
    CUDA it is enqueued on :attr:`stream` (a side stream) and ordered by events:

    * :meth:`to_host`: the side stream first waits for everything enqueued so far on the
      compute (current) stream, which wrote the blocks; then, after enqueueing the copies, the
      compute stream waits for them, so no later kernel can overwrite a block that is still
      being read;
    * :meth:`to_device`: the same two waits: the copy starts after the compute stream's earlier
      work on the destination blocks (a previous owner may still be reading them) and the
      compute stream's next kernels (the step that reads the restored prefix) start after it.

    Both return the CUDA event recorded after the copies (``None`` on the CPU): the host may read
    a buffer written by :meth:`to_host` only after ``event.synchronize()``. Host buffers must be
    pinned for the copies to be asynchronous (pageable memory makes them synchronous, correct
    but slow).
    """

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.cuda = kv.k.is_cuda
        self.stream = torch.cuda.Stream(device=kv.k.device) if self.cuda else None

    def _block(self, block: int) -> torch.Tensor | None:
        """Block ``block`` as one contiguous tensor (block-major cache), else None."""
        return self.kv.blocks[block] if self.kv.blocks is not None else None

    def _gather(self, block: int, buf: torch.Tensor) -> None:
        src = self._block(block)
        if src is not None:
            buf.copy_(src, non_blocking=True)
        else:  # layer-major: 2 * num_layers strided pieces
            buf[0].copy_(self.kv.k[:, block], non_blocking=True)
            buf[1].copy_(self.kv.v[:, block], non_blocking=True)

    def _scatter(self, buf: torch.Tensor, block: int) -> None:
        dst = self._block(block)
        if dst is not None:
            dst.copy_(buf, non_blocking=True)
        else:
            self.kv.k[:, block].copy_(buf[0], non_blocking=True)
            self.kv.v[:, block].copy_(buf[1], non_blocking=True)

    def _ordered(self, fn: Callable[[], None]) -> torch.cuda.Event | None:
        if not self.cuda:
            fn()
            return None
        compute = torch.cuda.current_stream(self.kv.k.device)
        self.stream.wait_stream(compute)  # after the kernels that wrote / still read these blocks
        with torch.cuda.stream(self.stream):
            fn()
            done = torch.cuda.Event()
            done.record(self.stream)
        compute.wait_event(done)  # before any later kernel touches these blocks
        return done

    def to_host(self, blocks: Sequence[int], bufs: Sequence[torch.Tensor]) -> torch.cuda.Event | None:
        """Copy device blocks ``blocks[i]`` into host buffers ``bufs[i]`` (class docstring)."""
        return self._ordered(lambda: [self._gather(b, buf) for b, buf in zip(blocks, bufs)])

    def to_device(self, bufs: Sequence[torch.Tensor], blocks: Sequence[int]) -> torch.cuda.Event | None:
        """Copy host buffers ``bufs[i]`` into device blocks ``blocks[i]`` (class docstring)."""
        return self._ordered(lambda: [self._scatter(buf, b) for buf, b in zip(bufs, blocks)])


# ------------------------------------------------------------------------------------------ tiers


class _LRU:
    """Keys (block hashes) mapped to slots of a fixed pool, least recently used first."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slots: OrderedDict[Hashable, int] = OrderedDict()
        self.free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    def __contains__(self, key: Hashable) -> bool:
        return key in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def touch(self, key: Hashable) -> int:
        self.slots.move_to_end(key)
        return self.slots[key]

    def insert(self, key: Hashable) -> tuple[int, tuple[Hashable, int] | None]:
        """A slot for ``key`` (new, or taken from the LRU key, which is returned with it)."""
        evicted = None
        if not self.free:
            evicted = self.slots.popitem(last=False)
            self.free.append(evicted[1])
        slot = self.free.pop()
        self.slots[key] = slot
        return slot, evicted

    def remove(self, key: Hashable) -> None:
        self.free.append(self.slots.pop(key))


class _Tier:
    """What both tiers answer from their :class:`_LRU` (``self.lru``): capacity, membership, size."""

    lru: _LRU

    @property
    def num_slots(self) -> int:
        return self.lru.num_slots

    def __contains__(self, key: Hashable) -> bool:
        return key in self.lru

    def __len__(self) -> int:
        return len(self.lru)


class HostTier(_Tier):
    """``num_slots`` block buffers in host memory with an LRU keyed by block hash.

    Storage: :attr:`buffers`, ``[num_slots, 2, num_layers, block_size, num_kv_heads, head_dim]``
    of the KV cache's dtype, pinned when ``pin`` (CUDA). :attr:`ready` holds, per slot, the CUDA
    event after which the slot's data is complete (None: complete now).

    Raises:
        ValueError: ``num_slots < 1``.
    """

    def __init__(self, num_slots: int, shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False) -> None:
        if num_slots < 1:
            raise ValueError(f"the host tier needs room for at least one block, got {num_slots} slots")
        self.buffers = torch.empty((num_slots, *shape), dtype=dtype, pin_memory=pin)
        self.lru = _LRU(num_slots)
        self.ready: list[torch.cuda.Event | None] = [None] * num_slots

    def slot_data(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s buffer once its pending copy (if any) has finished."""
        ev = self.ready[slot]
        if ev is not None:
            ev.synchronize()
            self.ready[slot] = None
        return self.buffers[slot]


class DiskTier(_Tier):
    """``num_slots`` block slots in one memory-mapped file, with an LRU keyed by block hash.

    The file (``infer-kv-<pid>-<random>.bin`` in ``directory``) is created sparse and deleted by
    :meth:`close` (or when the tier is garbage collected, or the interpreter exits). Writes
    (:meth:`put`) run on a background thread; until one lands, reads of that block are served
    from the copy handed to :meth:`put`.

    Raises:
        ValueError: ``num_slots < 1``. OSError: the directory is not writable.
    """

    def __init__(self, directory: str | os.PathLike, num_slots: int, shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        if num_slots < 1:
            raise ValueError(f"the disk tier needs room for at least one block, got {num_slots} slots")
        self.shape, self.dtype = shape, dtype
        self.nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"infer-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="w+", shape=(num_slots, self.nbytes))
        self._fd = os.open(self.path, os.O_RDWR)
        if hasattr(os, "posix_fallocate"):  # reserve the blocks now: the writes then only fill pages
            try:
                os.posix_fallocate(self._fd, 0, num_slots * self.nbytes)
            except OSError:
                pass  # a file system without fallocate: the file stays sparse
        self._finalizer = weakref.finalize(self, _remove_file, self.path, self._fd)
        self.lru = _LRU(num_slots)
        self._pending: dict[int, tuple[Hashable, torch.Tensor]] = {}  # slot -> (key, data) being written
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="infer-kv-disk")
        self.bytes_written = 0

    def _slot(self, slot: int) -> torch.Tensor:
        return torch.from_numpy(self._mm[slot]).view(self.dtype).view(self.shape)

    def put(self, key: Hashable, data: torch.Tensor) -> Hashable | None:
        """Store ``data`` (a CPU tensor of :attr:`shape` that the caller will not modify) as
        ``key``; returns the key evicted to make room, if any. The write happens in the background."""
        if key in self.lru:
            self.lru.touch(key)
            return None
        slot, evicted = self.lru.insert(key)
        with self._lock:
            self._pending[slot] = (key, data)
        self._writer.submit(self._write, slot, key, data)
        return evicted[0] if evicted else None

    def _write(self, slot: int, key: Hashable, data: torch.Tensor) -> None:
        # pwrite (the GIL is released) goes through the page cache's write path, several times
        # faster than storing into fresh pages of the mapping (a page fault per 4 KiB)
        os.pwrite(self._fd, data.contiguous().view(torch.uint8).numpy(), slot * self.nbytes)
        with self._lock:
            if self._pending.get(slot, (None,))[0] == key and self._pending[slot][1] is data:
                del self._pending[slot]
        self.bytes_written += self.nbytes

    def read(self, key: Hashable) -> torch.Tensor:
        """Block ``key``'s data: a view of the mapped file (or of the copy still being written).

        Raises:
            KeyError: ``key`` is not in the tier.
        """
        slot = self.lru.touch(key)
        with self._lock:
            pending = self._pending.get(slot)
        return pending[1] if pending is not None else self._slot(slot)

    def flush(self) -> None:
        """Wait for the writes submitted so far."""
        self._writer.submit(lambda: None).result()

    def drop_page_cache(self) -> None:
        """Write the file back and ask the OS to drop its cached pages, so that the next reads
        come from the disk itself (benchmarks: a cold read). A no-op where unsupported."""
        self.flush()
        self._mm.flush()
        if hasattr(os, "posix_fadvise"):
            shape = self._mm.shape
            self._mm = None  # pages still mapped are not dropped: unmap, drop, map again
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=shape)

    def close(self) -> None:
        """Finish the writes, unmap and delete the file. Idempotent."""
        if self._finalizer.alive:
            self._writer.shutdown(wait=True)
            self._mm = None
            self._finalizer()


def _remove_file(path: Path, fd: int | None = None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        path.unlink()
    except FileNotFoundError:
        pass


# ------------------------------------------------------------------------------------ the lookup


def tiered_lookup(hashes: Iterable[Hashable], on_device: Callable[[Hashable], bool],
                  lower_tiers: Sequence[tuple[str, Callable[[Hashable], bool]]]) -> list[str]:
    """Where each block of a prompt's longest cached prefix is, fastest tier first.

    Args:
        hashes: the prompt's full-block hashes, in order (each one covers its prefix).
        on_device: whether a block hash is cached in the device's KV cache.
        lower_tiers: ``(name, contains)`` of the tiers below the device, fastest first
            (``[("host", ...), ("disk", ...)]``).

    Returns:
        one tier name per leading block found (``"device"`` or a lower tier's name, the fastest
        tier holding it); the list stops at the first block that no tier holds, because a block's
        KV is only usable when every block before it is available too.
    """
    # >>> EXERCISE tiered_lookup
    found: list[str] = []
    for h in hashes:
        if on_device(h):
            found.append("device")
            continue
        for name, contains in lower_tiers:
            if contains(h):
                found.append(name)
                break
        else:
            break
    return found
    # <<< EXERCISE tiered_lookup


def break_even_tokens(kv_bytes_per_token: float, bandwidth_bytes_per_s: float, prefill_tokens_per_s: float,
                      fixed_latency_s: float = 0.0) -> int | None:
    """The shortest prefix (tokens) whose restore from a tier is faster than its recompute.

    Model: recomputing ``n`` tokens takes ``n / prefill_tokens_per_s`` seconds; restoring them
    takes ``fixed_latency_s + n * kv_bytes_per_token / bandwidth_bytes_per_s`` (a fixed cost:
    lookup, allocation, launching the copies, waiting on them; then the bytes at the tier's
    bandwidth). Restore wins when the per-token saving times ``n`` exceeds the fixed cost.

    Args:
        kv_bytes_per_token: bytes of K and V for one token across all layers
            (:meth:`~infer.config.ModelConfig.kv_bytes_per_token`).
        bandwidth_bytes_per_s: the tier's copy bandwidth (bytes/s).
        prefill_tokens_per_s: the engine's prefill rate at that length (tokens/s).
        fixed_latency_s: the restore's fixed cost (s).

    Returns:
        the smallest ``n >= 1`` with ``restore(n) < recompute(n)``, or None when restoring a
        token costs at least as much as recomputing it (restore never wins). Exact for
        :class:`fractions.Fraction` arguments.
    """
    # >>> EXERCISE break_even
    saving_per_token = 1 / Fraction(prefill_tokens_per_s) - Fraction(kv_bytes_per_token) / Fraction(
        bandwidth_bytes_per_s)
    if saving_per_token <= 0:
        return None
    return max(1, math.floor(Fraction(fixed_latency_s) / saving_per_token) + 1)
    # <<< EXERCISE break_even


# ---------------------------------------------------------------------------------- the offloader


class KVOffloader:
    """The tiers below one :class:`KVCache` and the copies between them.

    Args:
        kv: the device's KV cache.
        mode: ``"host"`` or ``"disk"`` (host with disk below it).
        host_bytes: the host tier's capacity (bytes; at least one block).
        disk_dir, disk_bytes: the disk tier's directory and capacity (``mode="disk"``).

    The prefix cache's eviction hook calls :meth:`offload` when it is about to reuse a cached
    block (its KV still intact); its lookup continues in :meth:`lower_tiers` (with
    :func:`tiered_lookup`) after a device miss, and admission calls :meth:`restore` with the
    device blocks it allocated for the blocks found there. Every method runs on the engine thread.
    ``stats()`` holds per-tier hits and bytes and the time spent offloading and restoring (host
    seconds spent issuing and, on the CPU, doing the copies).

    Raises:
        ValueError: unknown mode, or a tier too small for one block.
    """

    def __init__(self, kv: KVCache, mode: str, host_bytes: int, disk_dir: str | None = None,
                 disk_bytes: int | None = None) -> None:
        if mode not in ("host", "disk"):
            raise ValueError(f"kv_offload mode must be 'host' or 'disk', got {mode!r}")
        self.kv = kv
        self.copier = BlockCopier(kv)
        self.shape = block_shape(kv)
        self.block_nbytes = block_nbytes(kv)
        self.cuda = self.copier.cuda
        self.host = HostTier(host_bytes // self.block_nbytes, self.shape, kv.k.dtype, pin=self.cuda)
        self.disk: DiskTier | None = None
        if mode == "disk":
            if not disk_dir:
                raise ValueError("kv_offload='disk' needs kv_offload_dir")
            self.disk = DiskTier(disk_dir, (disk_bytes or 0) // self.block_nbytes, self.shape, kv.k.dtype)
        self.counters = {f"kv_offload_{k}": 0 for k in (
            "stored_blocks", "host_evictions", "disk_evictions", "host_hits", "disk_hits",
            "host_bytes_restored", "disk_bytes_restored", "bytes_offloaded", "bytes_spilled", "device_copies")}
        self.offload_time_s = 0.0
        self.restore_time_s = 0.0
        self._todo: list[tuple[int, int]] = []  # (device block, host slot): copies offload() queued

    # -------------------------------------------------------------- device -> host (-> disk)

    def offload(self, blocks: Sequence[tuple[Hashable, int]]) -> None:
        """Copy device blocks about to be reused into the host tier: ``(block hash, block id)`` pairs.

        A hash the host tier already holds is only marked recently used (its KV is the same).
        A full host tier evicts its LRU block, to the disk tier when there is one. The slots are
        taken now (a lookup finds the blocks at once); the copies are issued by :meth:`flush`,
        all together, which the engine calls before the next step launches (the blocks' new
        owners write them only then) and :meth:`restore` calls first.
        """
        t0 = time.perf_counter()
        for key, block in blocks:
            if key in self.host:
                self.host.lru.touch(key)
                continue
            slot, evicted = self.host.lru.insert(key)
            if evicted is not None:
                if any(s == evicted[1] for _, s in self._todo):  # a tier smaller than this batch
                    self.flush()
                self._spill(*evicted)
            self._todo.append((block, slot))
        self.offload_time_s += time.perf_counter() - t0

    def flush(self) -> None:
        """Issue the device -> host copies :meth:`offload` queued (one CUDA event for all)."""
        if not self._todo:
            return
        t0 = time.perf_counter()
        self._issue(self._todo)
        self.offload_time_s += time.perf_counter() - t0

    def _issue(self, todo: list[tuple[int, int]]) -> None:
        """Issue the device -> host copies of ``(block, slot)`` pairs, one event for all; empties ``todo``."""
        if not todo:
            return
        ev = self.copier.to_host([b for b, _ in todo], [self.host.buffers[s] for _, s in todo])
        for _, s in todo:
            self.host.ready[s] = ev
        self.counters["kv_offload_stored_blocks"] += len(todo)
        self.counters["kv_offload_bytes_offloaded"] += len(todo) * self.block_nbytes
        todo.clear()

    def _spill(self, key: Hashable, slot: int) -> None:
        """The host tier evicted ``key`` from ``slot`` (about to be overwritten): to disk, or gone."""
        self.counters["kv_offload_host_evictions"] += 1
        if self.disk is None or key in self.disk:
            if self.disk is not None:
                self.disk.lru.touch(key)
            return
        data = self.host.slot_data(slot).clone()  # the writer thread owns this copy
        if self.disk.put(key, data) is not None:
            self.counters["kv_offload_disk_evictions"] += 1
        self.counters["kv_offload_bytes_spilled"] += self.block_nbytes

    # -------------------------------------------------------------- lookup and restore

    def contains(self, key: Hashable) -> str | None:
        """``"host"``, ``"disk"`` or None: the fastest tier below the device holding ``key``."""
        if key in self.host:
            return "host"
        if self.disk is not None and key in self.disk:
            return "disk"
        return None

    def lower_tiers(self) -> list[tuple[str, Callable[[Hashable], bool]]]:
        """``(name, contains)`` of the tiers, fastest first, for :func:`tiered_lookup`."""
        tiers: list[tuple[str, Callable[[Hashable], bool]]] = [("host", self.host.__contains__)]
        if self.disk is not None:
            tiers.append(("disk", self.disk.__contains__))
        return tiers

    def restore(self, keys: Sequence[Hashable], blocks: Sequence[int],
                device_copies: Sequence[tuple[int, int]] = ()) -> None:
        """Copy blocks ``keys[i]`` (each in the host or the disk tier) into device blocks ``blocks[i]``,
        and device block ``src`` into ``dst`` for each ``(src, dst)`` of ``device_copies``.

        The copies :meth:`offload` queued are issued first (a destination block may be one just
        evicted). On CUDA the copies are enqueued and ordered before the compute stream's next
        kernels (:class:`BlockCopier`); a disk block is first read into pinned memory. On the
        CPU a disk block is copied from the mapped file straight into the cache.

        Raises:
            KeyError: a key no tier holds (look up first).
        """
        self.flush()
        t0 = time.perf_counter()
        for src, dst in device_copies:  # on the compute stream, in order with everything else there
            self.kv.copy_block_prefix(src, dst, self.kv.block_size)
        self.counters["kv_offload_device_copies"] += len(device_copies)
        bufs = []
        for key in keys:
            if key in self.host:
                bufs.append(self.host.buffers[self.host.lru.touch(key)])
                self.counters["kv_offload_host_hits"] += 1
                self.counters["kv_offload_host_bytes_restored"] += self.block_nbytes
                continue
            if self.disk is None or key not in self.disk:
                raise KeyError(f"block {key!r} is in no offload tier")
            data = self.disk.read(key)
            if self.cuda:  # DMA needs pinned memory (the caching host allocator reuses it after the copy)
                data = torch.empty(self.shape, dtype=data.dtype, pin_memory=True).copy_(data)
            bufs.append(data)
            self.counters["kv_offload_disk_hits"] += 1
            self.counters["kv_offload_disk_bytes_restored"] += self.block_nbytes
        if bufs:
            self.copier.to_device(bufs, blocks)
        self.restore_time_s += time.perf_counter() - t0

    # -------------------------------------------------------------- bookkeeping

    def stats(self) -> dict[str, float]:
        """Counters (blocks, bytes), occupancy and seconds, named for ``/metrics``."""
        s: dict[str, float] = dict(self.counters)
        s["kv_offload_host_blocks"] = len(self.host)
        s["kv_offload_host_capacity_blocks"] = self.host.num_slots
        s["kv_offload_disk_blocks"] = len(self.disk) if self.disk is not None else 0
        s["kv_offload_disk_capacity_blocks"] = self.disk.num_slots if self.disk is not None else 0
        s["kv_offload_time_s"] = self.offload_time_s
        s["kv_offload_restore_time_s"] = self.restore_time_s
        return s

    def reset(self) -> int:
        """Forget every block of every tier (with the prefix cache's ``reset_prefix_cache``);
        returns how many were dropped. Queued copies and disk writes finish first."""
        self.flush()
        if self.cuda:
            self.copier.stream.synchronize()
        dropped = len(self.host)
        self.host.lru = _LRU(self.host.num_slots)
        self.host.ready = [None] * self.host.num_slots
        if self.disk is not None:
            self.disk.flush()
            dropped += len(self.disk)
            self.disk.lru = _LRU(self.disk.num_slots)
        return dropped

    def check_invariants(self) -> None:
        """Every slot of each tier is either free or holds exactly one key (no leak, no double use).

        Raises:
            AssertionError: naming the tier.
        """
        tiers = [("host", self.host.lru)] + ([("disk", self.disk.lru)] if self.disk is not None else [])
        for name, lru in tiers:
            used = list(lru.slots.values())
            assert len(set(used)) == len(used), f"{name} tier: a slot holds two blocks"
            assert sorted(used + lru.free) == list(range(lru.num_slots)), f"{name} tier: slots leaked"

    def close(self) -> None:
        """Wait for outstanding copies and writes; delete the disk tier's file. Idempotent."""
        self.flush()
        if self.cuda:
            self.copier.stream.synchronize()
        if self.disk is not None:
            self.disk.close()
