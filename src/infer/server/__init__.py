"""The OpenAI-compatible server (phase 2): ``python -m infer.server``.

Where to read, in the order a request travels (``app.py``'s docstring walks one through):

- ``app.py``: :func:`~infer.server.app.build_app`, the app factory; it only wires (state, error
  handlers, body limit, HTTP metrics, OpenAPI schema, routers and the API key's check).
- ``routes/``: the endpoints, one ``APIRouter`` per module (``completions.py``, ``chat.py``,
  ``models.py``, ``admin.py``, ``health.py``); each handler is parse -> engine -> shape.
- ``serving.py``: what the routes share: the server state, the checks that refuse a request
  (``sampling_or_reject``), the engine call (``submit_all``, ``collect``) and its streams.
- ``responses.py``: OpenAI's response shapes: error bodies, SSE events, logprobs, usage.
- ``protocol.py``: the request (and documented response) models; ``tools.py``: tool calls.
- ``async_engine.py``: the engine thread and its handle, ``AsyncEngine``; ``metrics.py``: Prometheus;
  ``auth.py``: ``--api-key``.
"""
