"""Where a streamed request's first token spends its time on the way through the HTTP server, point by point.

    python benchmarks/server_path.py --model DIR --engine-args device=cuda dtype=bfloat16 optimize=true
    python benchmarks/server_path.py --model DIR --server-args=--no-engine-process   # the engine on a thread

Starts ``python -m infer.server`` through this file (``--serve``), which first wraps a few functions of the
server and of the engine process so that each writes ``time.perf_counter()`` (one monotonic clock for every
process of the machine) to a file as a request passes; then streams ``--requests`` greedy requests of
``--prompt-len`` random prompt tokens and ``--output-len`` tokens, ``--gap-ms`` apart (a server at low load),
through the standard library's ``http.client`` on one kept-alive connection, as ``server_latency.py`` does,
after ``--warmup`` requests. Reported: the median time of each point after the client's send, in ms:

* ``app``: uvicorn calls the ASGI app (the request's head parsed); ``body``: the app reads the body;
  ``handler``: the route's handler runs (FastAPI's validation and dependencies done);
* ``submit``: the prompts go to :meth:`~infer.server.async_engine.AsyncEngine.submit_many`; ``pipe_send``:
  the add is written to the engine process's pipe (``--engine-process``); ``engine_add``: the engine's side
  takes the add (the engine process's loop, or the engine thread); ``engine_added``: ``add_request``
  returned; ``accepted``: the handler has the engine's acceptance;
* ``first_step_end``, ``second_step_end``: the engine's first two steps after the add end (with async
  scheduling the first token leaves with the second); ``engine_out_sent``: the engine process writes the
  first token's output to the pipe; ``first_out``: the server's side reads it (reader thread, or the engine
  thread's hand-off); ``sse_send``: its SSE chunk goes to uvicorn; ``client``: the client reads it.

The hooks wrap functions by name (module attributes looked up at call time), so a renamed function shows as a
missing point, not as a wrong one. Writes the JSON report, the Markdown table beside it and a plot of the path
(``--out``, default ``benchmarks/runs/server_path.json``).
"""

from __future__ import annotations

import os
import sys

TRACE_ENV = "INFER_PATH_TRACE"  # the file the hooks append to; set for the server and its engine process

POINTS = ["app", "body", "handler", "submit", "pipe_send", "engine_add", "engine_added", "accepted",
          "first_step_end", "second_step_end", "engine_out_sent", "first_out", "sse_send", "client"]


def install_hooks(path: str) -> None:
    """Wrap the server's and the engine's functions so that each appends ``"<point> <perf_counter>"`` to
    ``path`` (one line, one write: two processes append to the same file)."""
    import time

    trace = open(path, "a", buffering=1)

    def mark(point: str) -> None:
        trace.write(f"{point} {time.perf_counter():.7f}\n")

    import infer.server.app as app_module
    import infer.server.async_engine as ae
    import infer.server.engine_core as ec
    import infer.server.routes.completions as completions

    build_app = app_module.build_app

    def traced_build_app(*args, **kwargs):
        app = build_app(*args, **kwargs)

        async def traced(scope, receive, send):
            if scope["type"] != "http" or scope["path"] != "/v1/completions":
                return await app(scope, receive, send)
            mark("app")
            state = {"body": False, "sse": False}

            async def traced_receive():
                message = await receive()
                if not state["body"]:
                    state["body"] = True
                    mark("body")
                return message

            async def traced_send(message):
                if (not state["sse"] and message["type"] == "http.response.body"
                        and b'"choices": [{' in message.get("body", b"")):
                    state["sse"] = True
                    mark("sse_send")
                await send(message)

            await app(scope, traced_receive, traced_send)

        return traced

    app_module.build_app = traced_build_app
    parse_completion = completions.parse_completion

    def traced_parse(*args, **kwargs):
        mark("handler")
        return parse_completion(*args, **kwargs)

    completions.parse_completion = traced_parse
    submit_many = ae.AsyncEngine.submit_many

    async def traced_submit(self, *args, **kwargs):
        mark("submit")
        streams = await submit_many(self, *args, **kwargs)
        mark("accepted")
        return streams

    ae.AsyncEngine.submit_many = traced_submit
    command = ec.EngineProcess._command

    def traced_command(self, cmd, arg, fut):
        if cmd == "add":
            mark("pipe_send")
        return command(self, cmd, arg, fut)

    ec.EngineProcess._command = traced_command
    deliver_step = ae.AsyncEngine._deliver_step

    def traced_deliver(self, outs):
        if any(o.request_id in self._awaiting_first for o in outs):
            mark("first_out")
        return deliver_step(self, outs)

    ae.AsyncEngine._deliver_step = traced_deliver
    # the engine's side: the process's loop (engine_core) or the thread's (async_engine)
    steps_since_add = [2]
    for module in (ec, ae):
        step_engine = module.step_engine

        def traced_step(*args, _step=step_engine, **kwargs):
            result = _step(*args, **kwargs)
            if steps_since_add[0] < 2:
                steps_since_add[0] += 1
                mark("first_step_end" if steps_since_add[0] == 1 else "second_step_end")
            return result

        module.step_engine = traced_step
    handle = ec._EngineLoop.handle

    def traced_handle(self, kind, key, arg):
        if kind == "add":
            mark("engine_add")
            steps_since_add[0] = 0
        done = handle(self, kind, key, arg)
        if kind == "add":
            mark("engine_added")
        return done

    ec._EngineLoop.handle = traced_handle
    send = ec._EngineLoop.send

    def traced_send_out(self, kind, key, value):
        if kind == "outs" and any(len(o.outputs[0].token_ids) == 1 for o in value[0] if o.outputs):
            mark("engine_out_sent")
        return send(self, kind, key, value)

    ec._EngineLoop.send = traced_send_out
    thread_handle = ae.AsyncEngine._handle

    def traced_thread_handle(self, cmd, arg, fut):
        if cmd == "add":
            mark("engine_add")
            steps_since_add[0] = 0
        thread_handle(self, cmd, arg, fut)
        if cmd == "add":
            mark("engine_added")

    ae.AsyncEngine._handle = traced_thread_handle


if os.environ.get(TRACE_ENV):  # the server (--serve) and, re-importing this file as its main, the engine process
    install_hooks(os.environ[TRACE_ENV])


def requests_from_trace(lines: list[str]) -> list[dict[str, float]]:
    """The trace's points grouped by request: a request starts at its ``app`` point (requests are sequential);
    each point's first occurrence in the request counts."""
    requests: list[dict[str, float]] = []
    for line in lines:
        point, t = line.split()
        if point == "app":
            requests.append({})
        if requests:
            requests[-1].setdefault(point, float(t))
    return requests


def path_rows(client: list[tuple[float, float]], requests: list[dict[str, float]]) -> list[dict]:
    """Per point of :data:`POINTS`, the median ms after the client's send (and the quartiles), over the
    requests where it was seen; in the order of the medians."""
    import statistics

    rows = []
    for point in POINTS:
        ms = [((r[point] if point != "client" else first) - start) * 1e3
              for (start, first), r in zip(client, requests) if point == "client" or point in r]
        if not ms:
            continue
        q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
        rows.append({"point": point, "median_ms": statistics.median(ms), "p25_ms": q[0], "p75_ms": q[2],
                     "requests": len(ms)})
    return sorted(rows, key=lambda r: r["median_ms"])  # (with async scheduling the first token leaves a step later)


def plot(rows: list[dict], path, title: str) -> None:
    """The path as one bar: each segment from a point to the next, labelled with its length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from common import save_figure

    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.25 * len(rows)))
    prev = 0.0
    for i, r in enumerate(rows):
        end = max(r["median_ms"], prev)
        ax.barh(0, end - prev, left=prev, color=f"C{i % 10}", edgecolor="white")
        ax.annotate(f"{r['point']} {r['median_ms']:.2f}", (end, 0.45 + 0.1 * (i % 4)), fontsize=7,
                    ha="right", rotation=0)
        prev = end
    ax.set_ylim(-0.5, 1.0)
    ax.set_yticks([])
    ax.set_xlabel("ms after the client's send (medians)")
    ax.set_title(title, fontsize=9)
    save_figure(fig, path)


def serve(argv: list[str]) -> int:
    """``--serve SERVER-ARGS``: the server, with the hooks installed (see the module docstring)."""
    from infer.server.__main__ import main

    return main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return serve(argv[1:])
    import argparse
    import http.client
    import random
    import shlex
    import shutil
    import subprocess
    import tempfile
    import time
    from pathlib import Path

    import common  # noqa: F401  (before torch: OMP_WAIT_POLICY)
    from common import (
        engine_overrides,
        environment,
        free_port,
        markdown_table,
        out_argument,
        server_flags,
        stream_http,
        write_report,
    )

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--gap-ms", type=float, default=20.0, help="pause between two requests")
    ap.add_argument("--engine-args", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="EngineConfig overrides, given to the server as its CLI flags")
    ap.add_argument("--server-args", type=shlex.split, default=[], metavar="FLAGS", help="more server flags")
    out_argument(ap, "server_path.json", "JSON report (and .md and .png beside it)")
    args = ap.parse_args(argv)
    overrides = engine_overrides(args.engine_args)
    overrides.setdefault("max_model_len", args.prompt_len + args.output_len + 16)
    port = free_port()
    trace_file = Path(tempfile.mkdtemp()) / "trace.txt"
    trace_file.touch()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", "--model", args.model, "--port", str(port),
           *server_flags(overrides), *args.server_args, "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, TRACE_ENV: str(trace_file)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        start = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server died: {proc.stderr.read().decode()[-2000:]}")
            try:
                conn.request("GET", "/health")
                response = conn.getresponse()
                response.read()
                if response.status == 200:
                    break
            except OSError:
                conn.close()
                time.sleep(0.1)
            if time.perf_counter() - start > 600:
                raise SystemExit("the server did not answer /health within 600 s")
        rng = random.Random(0)
        vocab = 700  # prompt ids below every model's vocabulary (the tiny test models' included)

        def one() -> tuple[float, float]:
            prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_len)]
            t0 = time.perf_counter()
            ttft, _ = stream_http(conn, prompt, args.output_len)
            return t0, t0 + ttft

        for _ in range(args.warmup):
            one()
            time.sleep(args.gap_ms / 1e3)
        time.sleep(0.2)
        trace_file.write_text("")  # the hooks append: only the timed requests' points from here on
        client = []
        for i in range(args.requests):
            client.append(one())
            time.sleep(args.gap_ms / 1e3)
            print(f"\rrequest {i + 1}/{args.requests}", end="", flush=True)
        print()
        time.sleep(0.3)
        requests = requests_from_trace(trace_file.read_text().splitlines())
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(trace_file.parent, ignore_errors=True)
    if len(requests) != len(client):
        raise SystemExit(f"the trace holds {len(requests)} requests, the client sent {len(client)}")
    rows = path_rows(client, requests)
    table = markdown_table(rows, ["point", "median_ms", "p25_ms", "p75_ms", "requests"])
    out = Path(args.out)
    import torch

    device = torch.device(overrides.get("device") or "cpu")
    write_report({"environment": environment(device), "args": vars(args), "rows": rows,
                  "server_command": cmd}, out, table)
    plot(rows, out.with_suffix(".png"), f"{Path(args.model).name}: a streamed request's path through the server, "
                                        f"{args.requests} requests {args.gap_ms:g} ms apart")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
