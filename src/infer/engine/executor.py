"""The worker processes of a tensor/expert-parallel engine, and the step they all run (phase 14).

Process model (vLLM's multiprocessing executor, reduced to its core)::

    rank 0 = the engine's process                 ranks 1 .. W-1 = spawned workers
    LLMEngine: scheduler, sampler, detokenizer    a ModelRunner each (their shard, their KV pool)
    ParallelModelRunner.execute(step)             loop:
      broadcast FORWARD header (gloo, host ints) --> recv header, build AttentionMetadata
      broadcast [ids | positions | slots] -------> recv (device group: NCCL on CUDA)
      forward (all-reduces with everybody) <------> forward (the same all-reduces)
      broadcast LOGITS rows ---------------------> gather logits (only rank 0 samples)
      sample

With ``cuda_graphs`` (phase 9) every rank captures the same decode graphs, collectives included
(NCCL kernels are recorded like any other; rank 0's CAPTURE command starts every rank's capture,
so all of them warm up and capture the buckets in the same order). A decode-only step is then::

      broadcast REPLAY header (B, bucket, width) -> recv header
      broadcast the packed inputs (NCCL) --------> recv them into the graph runner's buffer
      replay (forward + logits) <----------------> replay the same bucket
      sample

Every rank runs the same forward on the same tokens; only rank 0 knows about requests. The
step's inputs are already flat tensors and host lists (the model runner builds them), so the
message is a handful of integers per sequence.

Failures. A worker that dies closes its sockets: gloo raises at once in rank 0's next collective
("Connection closed by peer"), rank 0 stops every worker and raises
:class:`~infer.errors.ParallelWorkerError`, which the engine lets through (the step's requests end
with ``finish_reason="error"``; the server answers 503 from then on). Each worker asks the kernel
to kill it when its parent dies (``PR_SET_PDEATHSIG``), so a killed engine leaves no orphans, and a
clean exit (``LLMEngine.shutdown``, interpreter exit, the server's SIGTERM handling) sends SHUTDOWN
and joins every worker. With NCCL a rank that dies *inside* a GPU collective is only noticed when
the collective times out (``TIMEOUT``).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import itertools
import logging
import os
import signal
import socket
import sys
import threading
import weakref

import torch
import torch.distributed as dist

from infer.config import EngineConfig
from infer.engine.graph_staging import packed_size
from infer.engine.model_runner import ModelRunner
from infer.errors import ParallelWorkerError
from infer.kernels import pdl
from infer.loader import load_model
from infer.parallel.allreduce import make_all_reduce
from infer.parallel.state import ParallelState, building_for, set_parallel

log = logging.getLogger("infer")

FORWARD, LOGITS, COPY, SHUTDOWN, CAPTURE, REPLAY, LORA_ACTIVATE, LORA_REMOVE = 1, 2, 3, 4, 5, 6, 7, 8
TIMEOUT = datetime.timedelta(seconds=300)  # the longest a rank waits in a collective for the others


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_world_size(config: EngineConfig) -> int:
    """Ranks each machine runs: ``world_size / nnodes``. Node ``n`` runs ranks ``n * L .. n * L + L - 1``."""
    return config.world_size // config.nnodes


def rendezvous_url(config: EngineConfig) -> str:
    """Where the ranks meet (torch.distributed's TCP store, hosted by rank 0 on node 0).

    One machine: ``master_addr``/``master_port`` if given, else a free port on 127.0.0.1. Several:
    the fields, else torchrun's environment variables ``MASTER_ADDR``/``MASTER_PORT``, else
    127.0.0.1:29500 (torchrun's defaults); every machine must name node 0's address and the same port.
    """
    if config.nnodes == 1:
        return f"tcp://{config.master_addr or '127.0.0.1'}:{config.master_port or _free_port()}"
    addr = config.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = config.master_port or int(os.environ.get("MASTER_PORT") or 29500)
    return f"tcp://{addr}:{port}"


def init_rank(rank: int, world_size: int, url: str, config: EngineConfig) -> ParallelState:
    """Join the process group (NCCL on CUDA, gloo on the CPU) at ``url`` and describe this rank.

    On CUDA rank ``r`` uses its machine's GPU ``r mod L`` (:func:`local_world_size`); a second gloo
    group carries the host-side step messages. With ``all_reduce_backend='symm_mem'`` on CUDA the
    ranks also allocate and exchange their symmetric all-reduce buffers here (a collective).
    """
    cuda = config.resolved_device().type == "cuda"
    if cuda:
        torch.cuda.set_device(rank_device(config, rank))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=url, rank=rank,
                            world_size=world_size, timeout=TIMEOUT)
    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=TIMEOUT) if cuda else group
    state = ParallelState(rank, world_size, tp=True, ep=config.expert_parallel_size > 1, group=group,
                          cpu_group=cpu_group, all2all=config.all2all_backend,
                          capacity_factor=config.ep_capacity_factor)
    state.symm_mem = make_all_reduce(config.all_reduce_backend, group, rank_device(config, rank),
                                     config.symm_mem_max_bytes, config.symm_mem_one_shot_max_bytes, rank)
    return state


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    dev = config.resolved_device()
    return torch.device("cuda", rank % local_world_size(config)) if dev.type == "cuda" else dev


HEADER = 16  # int64s per command message: [cmd, n, the payload when n <= HEADER - 2]


def send(state: ParallelState, cmd: int, payload: list[int] = ()) -> None:
    """Rank 0: broadcast one command and its int64 payload over the host (gloo) group.

    One fixed-size message carries the command with a short payload inline (a decode step's
    REPLAY, COPY): a gloo broadcast is a TCP round trip, tens to hundreds of microseconds, paid
    every step. A longer payload (FORWARD's block tables) follows in a second message."""
    n = len(payload)
    header = torch.zeros(HEADER, dtype=torch.int64)
    header[0], header[1] = cmd, n
    if n <= HEADER - 2:
        header[2:2 + n] = torch.tensor(payload, dtype=torch.int64)
    dist.broadcast(header, 0, group=state.cpu_group)
    if n > HEADER - 2:
        dist.broadcast(torch.tensor(payload, dtype=torch.int64), 0, group=state.cpu_group)


def recv(state: ParallelState) -> tuple[int, list[int]]:
    """Ranks > 0: the next command rank 0 broadcast, and its payload."""
    header = torch.empty(HEADER, dtype=torch.int64)
    dist.broadcast(header, 0, group=state.cpu_group)
    h = header.tolist()
    cmd, n = h[0], h[1]
    if n <= HEADER - 2:
        return cmd, h[2:2 + n]
    payload = torch.empty(n, dtype=torch.int64)
    dist.broadcast(payload, 0, group=state.cpu_group)
    return cmd, payload.tolist()


def agree_num_blocks(state: ParallelState, num_blocks: int) -> int:
    """Every rank sizes its KV pool alone; all take the smallest (rank 0's scheduler hands out block
    ids that must exist on every rank)."""
    t = torch.tensor([num_blocks], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=state.cpu_group)
    return int(t.item())


def pack_step(meta) -> list[int]:
    """The host half of a FORWARD message: ``[T, B, num_decodes, query_start_loc (B + 1),
    seq_lens (B), table lengths (B), the block tables back to back]``."""
    tables = meta.block_tables_cpu
    return [meta.query_start_loc_cpu[-1], meta.num_seqs, meta.num_decodes, *meta.query_start_loc_cpu,
            *meta.seq_lens_cpu, *map(len, tables), *itertools.chain.from_iterable(tables)]


def unpack_step(p: list[int]) -> tuple[int, list[int], list[int], list[list[int]], int]:
    """:func:`pack_step`'s inverse: ``(T, query_start_loc, seq_lens, block tables, num_decodes)``."""
    t, b, nd = p[0], p[1], p[2]
    starts, seq_lens, lens = p[3:4 + b], p[4 + b:4 + 2 * b], p[4 + 2 * b:4 + 3 * b]
    flat, tables, at = p[4 + 3 * b:], [], 0
    for n in lens:
        tables.append(flat[at:at + n])
        at += n
    return t, starts, seq_lens, tables, nd


def pack_loras(loras, in_use: set[int]) -> list[int]:
    """A LORA_ACTIVATE message (LoRA, phase 16): ``[n, (id, name length, name bytes, path length, path
    bytes) x n, in-use count, in-use ids]``: every rank runs the same activation, so the slots agree."""
    out = [len(loras)]
    for lora in loras:
        name, path = lora.lora_name.encode(), lora.lora_path.encode()
        out += [lora.lora_int_id, len(name), *name, len(path), *path]
    return out + [len(in_use), *sorted(in_use)]


def unpack_loras(p: list[int]) -> tuple[list, set[int]]:
    """:func:`pack_loras`' inverse: ``(LoRARequest s, in-use ids)``."""
    from infer.lora import LoRARequest

    loras, at = [], 1
    for _ in range(p[0]):
        rid, n = p[at], p[at + 1]
        name = bytes(p[at + 2:at + 2 + n]).decode()
        at += 2 + n
        m = p[at]
        path = bytes(p[at + 1:at + 1 + m]).decode()
        at += 1 + m
        loras.append(LoRARequest(name, rid, path))
    return loras, set(p[at + 1:at + 1 + p[at]])


class ParallelModelRunner(ModelRunner):
    """Rank 0's model runner: every call that touches the model or the KV cache is first broadcast,
    so the workers run it too (:func:`serve` is their side). The rest (flattening the step, the
    sampling tensors, sampling) happens on rank 0 only.

    Raises (from :meth:`execute`):
        ParallelWorkerError: a collective failed (a rank died): the workers are stopped.
    """

    def __init__(self, *args, workers: Workers, **kwargs) -> None:
        self.workers = workers
        super().__init__(*args, **kwargs)
        if self.graphs is not None:
            self.graphs.on_staged = self._send_replay

    def execute(self, *args, **kwargs):
        self.workers.check()
        return super().execute(*args, **kwargs)

    @contextlib.contextmanager
    def _collective(self):
        """Any failure while ranks exchange messages leaves them out of step: fatal."""
        try:
            yield
        except Exception as e:
            raise self.workers.fail(e) from e

    def _forward(self, input_ids, positions, meta):
        with self._collective():
            st = self.workers.state
            send(st, FORWARD, pack_step(meta))
            rows = [input_ids, positions, meta.slot_mapping]
            if self.lora_manager is not None:  # LoRA: each row's adapter slot, the same on every rank
                slots = self.lora_manager.mapping.token_slots
                rows.append(self._to_device(slots if slots is not None else [-1] * len(input_ids), torch.int64))
            dist.broadcast(torch.stack(rows), 0, group=st.group)
            return super()._forward(input_ids, positions, meta)

    def activate_loras(self, loras, in_use):
        with self._collective():
            send(self.workers.state, LORA_ACTIVATE, pack_loras(loras, in_use))
        super().activate_loras(loras, in_use)

    def remove_lora(self, lora_int_id):
        with self._collective():
            send(self.workers.state, LORA_REMOVE, [lora_int_id])
        return super().remove_lora(lora_int_id)

    def _logits(self, hidden, rows):
        with self._collective():
            send(self.workers.state, LOGITS, list(range(rows.start, rows.stop)) if isinstance(rows, slice) else rows)
            return super()._logits(hidden, rows)

    def _copy_block_prefix(self, src, dst, length):
        with self._collective():
            send(self.workers.state, COPY, [src, dst, length])
            super()._copy_block_prefix(src, dst, length)

    def capture_cuda_graphs(self, progress: bool = True) -> float:
        if self.graphs is None:
            return 0.0
        with self._collective():
            send(self.workers.state, CAPTURE)
            return super().capture_cuda_graphs(progress)

    def _send_replay(self, b: int, bs: int, width: int, packed: torch.Tensor, lora: bool = False) -> None:
        """A decode step about to replay bucket ``bs``: the other ranks replay it too, on the same
        packed inputs (ids patched by async scheduling included) and, for its LoRA variant, the same
        row groups (:class:`~infer.lora.graphs.LoRAGraphInputs`)."""
        with self._collective():
            st = self.workers.state
            send(st, REPLAY, [b, bs, width, int(lora)])
            dist.broadcast(packed, 0, group=st.group)
            if lora:
                dist.broadcast(self.graphs.lora.buffer[: self.graphs.lora.size(b)], 0, group=st.group)


@torch.inference_mode()
def serve(runner: ModelRunner, state: ParallelState) -> None:
    """A worker's loop: run each command rank 0 broadcasts until SHUTDOWN."""
    hidden = None
    while True:
        cmd, p = recv(state)
        if cmd == FORWARD:
            t, starts, seq_lens, tables, nd = unpack_step(p)
            lora = runner.lora_manager
            packed = torch.empty((3 if lora is None else 4, t), dtype=torch.int64, device=runner.device)
            dist.broadcast(packed, 0, group=state.group)
            if lora is not None:
                lora.set_mapping(packed[3].tolist())
            meta = runner._metadata(starts, seq_lens, packed[2], tables, nd)
            hidden = runner._forward(packed[0], packed[1], meta)
        elif cmd == LOGITS:
            runner._logits(hidden, p)  # the gather needs every rank; only rank 0 samples
        elif cmd == COPY:
            runner._copy_block_prefix(*p)
        elif cmd == REPLAY:
            b, bs, width, lora = p
            packed = runner.graphs.packed[: packed_size(b, bs, width)]
            dist.broadcast(packed, 0, group=state.group)
            if lora:  # the LoRA variant: rank 0's row groups
                dist.broadcast(runner.graphs.lora.buffer[: runner.graphs.lora.size(b)], 0, group=state.group)
            runner.graphs.run_packed(b, bs, width, bool(lora))
        elif cmd == CAPTURE:
            runner.capture_cuda_graphs(progress=False)
        elif cmd == LORA_ACTIVATE:
            runner.activate_loras(*unpack_loras(p))
        elif cmd == LORA_REMOVE:
            runner.remove_lora(p[0])
        elif cmd == SHUTDOWN:
            return
        else:  # pragma: no cover
            raise RuntimeError(f"unknown command {cmd}")


def build_runner(config: EngineConfig, state: ParallelState, runner_cls=ModelRunner, progress: bool = False,
                 **runner_kwargs):
    """Load this rank's shard and build its model runner the way :class:`LLMEngine` does
    (:meth:`ModelRunner.from_config`: the same max_model_len, block size, fused ops and, agreed between
    the ranks, KV-pool size on every rank). Returns ``(loaded, runner)``."""
    with building_for(state):
        loaded = load_model(config.model, rank_device(config, state.rank), config.resolved_dtype(), progress=progress,
                            quantization=config.quantization, quantize_lm_head=config.quantize_lm_head,
                            gguf_weights=config.gguf_weights)
    runner = runner_cls.from_config(config, loaded, agree_num_blocks=lambda n: agree_num_blocks(state, n),
                                    **runner_kwargs)
    return loaded, runner


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (no orphans, whatever
    killed the engine)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _worker_main(rank: int, world_size: int, url: str, config: EngineConfig, parent: int) -> None:
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: rank 0 decides
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(message)s")
    code = run_rank(rank, world_size, url, config)
    os._exit(code)  # skip interpreter teardown: the process group's C++ threads may still be winding down


def run_rank(rank: int, world_size: int, url: str, config: EngineConfig) -> int:
    """Everything a rank other than 0 does: join the group, build its runner, :func:`serve` until
    SHUTDOWN, leave. Returns the exit code: 0, or 1 after logging the failure."""
    try:
        state = init_rank(rank, world_size, url, config)
        set_parallel(state)
        _, runner = build_runner(config, state)
        with pdl.scope(runner.pdl):  # serve() runs the runner's forwards and graphs directly
            serve(runner, state)
        if runner.graphs is not None:
            runner.graphs.release()  # before the communicator goes (PyTorch #115388)
        _destroy_group()
    except Exception:
        log.exception("rank %d failed", rank)
        sys.stderr.flush()
        return 1
    sys.stderr.flush()
    return 0


class Workers:
    """Rank 0's handle on the worker processes (ranks 1 .. W-1) and the process group.

    Starting it spawns the workers (``torch.multiprocessing``'s spawn context: a fresh interpreter
    each, as CUDA requires) and joins the group as rank 0. :meth:`shutdown` is idempotent and also
    runs at interpreter exit (``weakref.finalize``).

    ``config`` must be validated (:meth:`EngineConfig.validate` checks that its parallel sizes split
    the model). Raises RuntimeError when this process already runs a parallel engine.
    """

    def __init__(self, config: EngineConfig) -> None:
        if dist.is_initialized():
            raise RuntimeError("a parallel engine is already running in this process (torch.distributed "
                               "holds one process group per process); shut it down first")
        if config.node_rank != 0:
            raise ValueError(f"node_rank={config.node_rank}: only node 0 runs the engine; start the other "
                             "machines with `python -m infer.server ... --node-rank N` (run_node)")
        self.world_size = config.world_size
        url = rendezvous_url(config)
        self.procs = _spawn_ranks(range(1, local_world_size(config)), url, config)
        self.error: ParallelWorkerError | None = None
        self._joined: list[ParallelState] = []  # rank 0's state once it is in the group
        self._finalizer = weakref.finalize(self, _shutdown, self._joined, self.procs)
        try:
            self.state = init_rank(0, self.world_size, url, config)
        except BaseException:
            self._finalizer()
            raise
        self._joined.append(self.state)

    def check(self) -> None:
        """Raise the failure recorded earlier, or :class:`ParallelWorkerError` if a worker is gone."""
        if self.error is not None:
            raise self.error
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            raise self.fail(RuntimeError("worker exited"))

    def fail(self, cause: BaseException) -> ParallelWorkerError:
        """Record a fatal failure, stop every worker, return the error to raise."""
        if self.error is None:
            for p in self.procs:
                p.join(timeout=0.5)  # a rank that closed its sockets is exiting: let its exit code arrive
            dead = ", ".join(f"rank {i + 1} (exit code {p.exitcode})" for i, p in enumerate(self.procs)
                             if p.exitcode is not None)
            self.error = ParallelWorkerError(
                f"{'worker ' + dead + ' died' if dead else 'the ranks fell out of step'} "
                f"({type(cause).__name__}: {cause}); the parallel engine has stopped")
            log.error("%s", self.error)
            self._joined.clear()  # no SHUTDOWN message: nobody is listening any more
            self._finalizer()
        return self.error

    def shutdown(self) -> None:
        """Tell every worker to exit, wait for them, leave the process group. Idempotent."""
        self._finalizer()


def _spawn_ranks(ranks, url: str, config: EngineConfig) -> list:
    """Start one worker process per rank (``torch.multiprocessing``'s spawn context: a fresh
    interpreter each, as CUDA requires); each dies with this process."""
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker_main, args=(r, config.world_size, url, config, os.getpid()),
                         name=f"infer-rank{r}", daemon=True) for r in ranks]
    for p in procs:
        p.start()
    return procs


def run_node(config: EngineConfig) -> int:
    """A machine other than node 0 (``node_rank`` > 0): run its ranks until node 0 shuts them down.

    Its ranks join node 0's process group at :func:`rendezvous_url` and run :func:`serve`; node 0's
    engine schedules, samples and serves. The node's first rank runs in this process, the others
    in spawned workers. Returns 0 when every rank exited cleanly, else 1. The caller should leave
    with ``os._exit`` (the process group's threads may still be winding down).

    Raises:
        ValueError: ``node_rank`` is 0 (node 0 runs :class:`~infer.engine.LLMEngine`).
    """
    config.validate()
    if config.node_rank == 0:
        raise ValueError("run_node is for node_rank > 0; node 0 runs the engine (LLMEngine, infer.server)")
    local = local_world_size(config)
    first = config.node_rank * local
    url = rendezvous_url(config)
    log.info("node %d of %d: ranks %d .. %d, rendezvous at %s", config.node_rank, config.nnodes, first,
             first + local - 1, url)
    procs = _spawn_ranks(range(first + 1, first + local), url, config)
    code = run_rank(first, config.world_size, url, config)
    _stop(procs, graceful=code == 0)
    codes = [code, *(p.exitcode for p in procs)]
    if any(codes):
        log.error("node %d: ranks %d .. exited with %s", config.node_rank, first, codes)
    return 1 if any(codes) else 0


def _shutdown(joined: list[ParallelState], procs) -> None:
    """SHUTDOWN to the workers when the group is whole, leave the group, join (or kill) them.

    Order matters: NCCL's communicator teardown waits for every rank to tear down too, so rank 0
    leaves the group *while* the workers leave it. Joining the workers first deadlocked: each worker
    waited in its teardown for rank 0, rank 0 waited in ``join`` for the worker, until both timed out
    (10 s + 10 s per engine, seen on two H200s). A group that is not whole (a rank died) is left
    after the workers are gone, still bounded by ``_destroy_group``'s timeout."""
    if joined:
        with contextlib.suppress(Exception):
            send(joined[0], SHUTDOWN)
        _destroy_group()
        _stop(procs, graceful=True)
    else:
        _stop(procs, graceful=False)
        _destroy_group()


def _destroy_group(timeout_s: float = 10.0) -> None:
    """Leave the process group, but never hang there: NCCL's communicator teardown can block (a
    CUDA graph that captured its collectives still alive, a peer gone mid-collective); after
    ``timeout_s`` seconds the process goes on without it."""
    if not dist.is_initialized():
        return

    def destroy():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    t = threading.Thread(target=destroy, name="infer-destroy-process-group", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.warning("leaving the process group took over %.0f s; going on without it", timeout_s)


def _stop(procs, graceful: bool) -> None:
    """Join the workers (after SHUTDOWN), then terminate and kill whatever is left."""
    for p in procs:
        if graceful:
            p.join(timeout=10)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
