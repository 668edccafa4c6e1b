"""``python -m infer.server``: serve a model over an OpenAI-compatible HTTP API.

    python -m infer.server                                  # smollm2-135m on 127.0.0.1:8000
    python -m infer.server --model gemma3-270m --port 8001
    python -m infer.server --help                           # every flag
    INFER_API_KEY=secret python -m infer.server --host 0.0.0.0  # reachable from the network: set a key

With ``--nnodes N`` the tensor/expert-parallel ranks span N machines: node 0 (``--node-rank 0``)
serves; on the others (``--node-rank 1 ..``, same flags) the process only runs that machine's ranks
(no HTTP server) and exits when node 0 shuts down (docs/phases/14-tensor-parallelism.md).

Every :class:`~infer.config.EngineConfig` field is a flag. SIGINT/SIGTERM shut down
gracefully: in-flight requests end with ``finish_reason="abort"`` (streams get their final
chunk and ``[DONE]``), then the process exits.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
import time

from infer.config import add_engine_args, engine_config_from_args
from infer.errors import ModelLoadError

SWITCH_INTERVAL_S = 0.0002  # sys.setswitchinterval while serving (see main)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model value)")
    s.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests allowed to wait for admission before the server answers 503 (default: 256)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on every route but /health and /metrics (default: "
                        "$INFER_API_KEY, else vLLM's $VLLM_API_KEY, else none)")
    s.add_argument("--live-page", action="store_true",
                   help="serve a page that draws the engine at work at /live: its queues, KV-cache blocks and "
                        "last steps (docs/reading-the-engine.md; behind --api-key when one is set; default: off)")
    s.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH", type=lora_module,
                   help="LoRA adapters to serve (needs --enable-lora): each NAME=PATH a PEFT adapter directory, "
                        "selected by requests whose model is NAME (vLLM's flag)")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine in a process of its own (vLLM's engine core process), so that the server's "
                        "HTTP work and the engine's steps run in parallel instead of taking turns on one Python "
                        "interpreter (docs/phases/02-server.md; not with --live-page); default: on with --optimize "
                        "on one GPU, else off (the engine on a thread of the server's process)")
    s.add_argument("--busy-poll-ms", type=float, default=None, metavar="MS",
                   help="with --engine-process: how long the idle engine process polls for the next request after "
                        "its last step before it sleeps, and the server's event loop its sockets after the last "
                        "output, sparing the next request their wake-ups (costs two CPU cores meanwhile); "
                        "default: 50 on a GPU, 0 on the CPU (where the engine's threads need every core)")
    add_engine_args(p)
    return p


def engine_placement(engine_process: bool | None, busy_poll_ms: float | None, optimize: bool, on_gpu: bool,
                     live_page: bool, parallel: bool = False) -> tuple[bool, float]:
    """Where the engine runs and how long its process busy-polls when idle (ms): the flags as given, else
    the engine in its own process with ``--optimize`` on one GPU (not with the live page, which reads the
    engine in-process, nor yet by default with several ranks, ``parallel``: measured on one GPU only) and
    50 ms of busy polling on a GPU, none on the CPU.

    Raises:
        ValueError: a negative ``busy_poll_ms``.
    """
    if engine_process is None:  # --optimize on a GPU: the engine's host work beside the server's
        engine_process = optimize and on_gpu and not live_page and not parallel
    if busy_poll_ms is None:
        busy_poll_ms = 50.0 if on_gpu else 0.0
    if busy_poll_ms < 0:
        raise ValueError(f"--busy-poll-ms must be >= 0, got {busy_poll_ms}")
    return engine_process, busy_poll_ms


def lora_module(value: str) -> tuple[str, str]:
    """``--lora-modules``' ``NAME=PATH``."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def resolve_api_key(flag: str | None, env=os.environ) -> str | None:
    """The API key: ``--api-key``, else ``$INFER_API_KEY``, else vLLM's ``$VLLM_API_KEY`` (a vLLM
    user's deployment that sets it must not end up open), else None; an empty value means none."""
    return flag or env.get("INFER_API_KEY") or env.get("VLLM_API_KEY") or None


def is_loopback(host: str) -> bool:
    """Does ``--host`` bind only this machine (``localhost``, 127.0.0.0/8, ``::1``)?"""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # another host name: it may resolve to any interface
        return False


def warn_if_exposed(host: str, api_key: str | None, log: logging.Logger) -> bool:
    """Log a warning when the server listens beyond this machine without an API key; returns
    whether it did."""
    if api_key or is_loopback(host):
        return False
    log.warning("serving on %s without an API key: anyone who can reach this port can use the model; "
                "set --api-key (or INFER_API_KEY)", host)
    return True


def freeze_startup_heap() -> int:
    """Move every object alive now out of the garbage collector's reach; returns how many.

    What start-up built (modules, the model and tokenizer, CUDA graphs, the app) lives as long as the
    process, yet each full (oldest-generation) collection walks all of it: measured here, 110 ms for
    the ~211,000 objects of a SmolLM2 server process on the CPU, a pause of every stream at some
    random step (the single 113-146 ms gaps of phase 6's GPU runs look like it). Collected once, then
    frozen (``gc.freeze``), those objects are skipped by every later collection; garbage made while
    serving is collected as before. vLLM freezes its engine's start-up heap the same way.
    """
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _run_node(config) -> int:
    """``--node-rank`` > 0: run this machine's ranks of node 0's engine until it shuts them down;
    no HTTP server here."""
    from infer.engine.executor import run_node
    from infer.engine.llm_engine import _check_parallel_split

    config.validate()
    _check_parallel_split(config)
    code = run_node(config)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: the process group's threads may still be winding down


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.node_rank > 0:  # more than one machine: this one only runs its ranks (node 0 serves)
        try:
            return _run_node(engine_config_from_args(args))
        except (ValueError, TypeError, ModelLoadError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    import uvicorn

    from infer.engine import LLMEngine
    from infer.server.app import build_app
    from infer.server.async_engine import AsyncEngine

    log = logging.getLogger("infer.server")
    start = time.perf_counter()
    # The engine thread and the event loop share the GIL. A thread that wants it waits until the one
    # holding it blocks or has run for the switch interval (5 ms by default): a token the engine has
    # handed over would wait behind the next step's Python, and a step's launch behind the loop's work
    # on a new request. 0.2 ms bounds each such wait; on an H100 host, 32 streams decoding through the
    # server made as many tokens per second at 0.2 ms as at 1 ms (docs/phases/02-server.md).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        config = engine_config_from_args(args)
        engine_process, busy_poll_ms = engine_placement(
            args.engine_process, args.busy_poll_ms, config.optimize, config.resolved_device().type == "cuda",
            args.live_page, parallel=config.tensor_parallel_size > 1 or config.expert_parallel_size > 1)
        if engine_process:
            from infer.server.engine_core import EngineProcess

            async_engine = EngineProcess(config, max_waiting=args.max_waiting_requests, log_level=args.log_level,
                                         busy_poll_s=busy_poll_ms / 1e3)
        else:  # built on the engine thread, which then steps it: one OpenMP pool in the process (see
            # async_engine.py's docstring for what a second one costs)
            async_engine = AsyncEngine(lambda: LLMEngine(config), max_waiting=args.max_waiting_requests)
    except (ValueError, TypeError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or args.model
    api_key = resolve_api_key(args.api_key)
    try:
        app = build_app(async_engine, name, api_key=api_key, live_page=args.live_page,
                        lora_modules=dict(args.lora_modules or []))
    except ValueError as e:
        async_engine.shutdown(timeout=5.0)
        print(f"error: {e}", file=sys.stderr)
        return 2
    warn_if_exposed(args.host, api_key, log)
    frozen = freeze_startup_heap()
    log.info("model %s loaded on %s in %.1f s (%d start-up objects frozen out of garbage collection; the engine %s); "
             "serving on http://%s:%d%s", name, async_engine.info.device, time.perf_counter() - start, frozen,
             f"in a process of its own, busy polling {busy_poll_ms:g} ms when idle" if async_engine.engine is None
             else "on a thread of this process",
             args.host, args.port, " (API key required)" if api_key else "")
    if args.live_page:
        log.info("live page: http://%s:%d/live%s", args.host, args.port, "#key=<your key>" if api_key else "")

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGINT/SIGTERM: end in-flight requests first
            async_engine.shutdown(timeout=5.0)
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=5))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it has already handled gracefully
        return 130
    finally:
        async_engine.shutdown(timeout=5.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
