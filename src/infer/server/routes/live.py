"""The live page (``python -m infer.server --live-page``): the engine's queues, KV-cache blocks and
last steps, drawn in the browser while it serves.

* ``GET /live``: the page (``static/live/index.html``, with ``live.js`` and ``live.css`` beside it:
  plain HTML, CSS and JavaScript, no build step, nothing fetched from another host);
* ``GET /live/snapshot``: what the page draws first: the server's ``info`` (model, flags, KV-cache
  shape), an ``instance`` id (new at every start: a page that sees it change after reconnecting
  starts over) and a ``state`` taken on the engine thread between two steps
  (:meth:`~infer.engine.live_view.LiveView.snapshot`);
* ``GET /live/events``: a Server-Sent Events stream: ``hello`` (info, instance), a fresh ``state``,
  then ``steps`` (a JSON list of step events, :meth:`~infer.engine.live_view.LiveView.step_event`)
  and ``state`` again as the engine publishes them, ``dropped`` when this reader fell behind the
  ring, a fresh ``state`` every :data:`QUIET_S` seconds while no step runs (a request aborted while
  it waited changes the queues without a step; the line also keeps proxies from closing the
  connection), and ``stopped`` when the engine is gone. The handler reads the engine's ring
  (:class:`~infer.engine.live_view.LiveView`) every :data:`POLL_S` seconds: the engine thread
  never waits for a client, and a slow client only misses the oldest events.

With an API key, ``/live/snapshot`` and ``/live/events`` need ``Authorization: Bearer <key>`` like
the API; the page itself holds no data and is served to anyone (a browser cannot send that header
when it opens a URL). The page takes the key from the address's fragment (``/live#key=<key>``,
never sent to the server or written to its access log) or asks for it, and sends it with
``fetch``, which, unlike ``EventSource``, can set headers.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from infer.engine.live_view import LiveView
from infer.server.async_engine import AsyncEngine, EngineDead
from infer.server.responses import error_response

STATIC = Path(__file__).resolve().parent.parent / "static" / "live"
#: how often the event stream reads the engine's ring (seconds)
POLL_S = 0.05
#: a fresh state after this long without an event (seconds)
QUIET_S = 2.0

page_router = APIRouter(include_in_schema=False)  # open: the page and its script hold no data
data_router = APIRouter(include_in_schema=False)  # the API key's, when the server has one


class LiveState:
    """What the live routes share: the engine's handle, its :class:`LiveView`, this start's id."""

    def __init__(self, engine: AsyncEngine, view: LiveView) -> None:
        self.engine, self.view = engine, view
        self.instance = uuid.uuid4().hex


def _live(request: Request) -> LiveState:
    return request.app.state.live


def _static(name: str, media_type: str) -> FileResponse:
    return FileResponse(STATIC / name, media_type=media_type, headers={"Cache-Control": "no-cache"})


@page_router.get("/live")
async def page() -> Response:
    return _static("index.html", "text/html; charset=utf-8")


@page_router.get("/live/live.js")
async def script() -> Response:
    return _static("live.js", "text/javascript; charset=utf-8")


@page_router.get("/live/live.css")
async def style() -> Response:
    return _static("live.css", "text/css; charset=utf-8")


@data_router.get("/live/snapshot")
async def snapshot(request: Request) -> Response:
    live = _live(request)
    try:
        state = await live.engine.call(lambda _eng: live.view.snapshot())
    except EngineDead:
        return error_response(503, "the engine is not running", None, "server_unavailable")
    return JSONResponse({"instance": live.instance, "info": live.view.info,
                         "num_events": live.view.num_events, "state": state})


def _sse(event: str, data) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def event_stream(request: Request, live: LiveState):
    """The ``/live/events`` stream (module docstring); ends when the client goes or the engine stops."""
    view = live.view
    yield _sse("hello", {"instance": live.instance, "info": view.info})
    after = view.num_events
    try:
        yield _sse("state", await live.engine.call(lambda _eng: view.snapshot()))
    except EngineDead:
        yield _sse("stopped", {})
        return
    quiet_since = time.monotonic()
    while True:
        items, dropped = view.since(after)
        if dropped:
            yield _sse("dropped", {"events": dropped})
        if items:
            after = items[-1][0] + 1
            steps = [view.step_event(*payload) for _, kind, payload in items if kind == "step"]
            states = [payload for _, kind, payload in items if kind == "state"]
            if steps:
                yield _sse("steps", steps)
            if states:
                yield _sse("state", states[-1])
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > QUIET_S and live.engine.alive:
            try:  # idle (or one long step): the engine thread answers between two steps
                yield _sse("state", await live.engine.call(lambda _eng: view.snapshot()))
            except EngineDead:
                pass
            quiet_since = time.monotonic()
        if not live.engine.alive:
            yield _sse("stopped", {})
            return
        if await request.is_disconnected():
            return
        await asyncio.sleep(POLL_S)


@data_router.get("/live/events")
async def events(request: Request) -> Response:
    return StreamingResponse(event_stream(request, _live(request)), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
