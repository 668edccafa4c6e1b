"""The endpoints, one ``APIRouter`` per module; ``build_app`` (``app.py``) includes them all.

- ``completions.py``: ``POST /v1/completions``
- ``chat.py``: ``POST /v1/chat/completions``
- ``models.py``: ``GET /v1/models``, ``GET /v1/models/{id}``, vLLM's ``POST /tokenize``,
  ``POST /detokenize`` and ``GET /tokenizer_info``
- ``admin.py``: vLLM's ``POST /reset_prefix_cache``, Prometheus' ``GET /metrics``
- ``health.py``: ``GET /health``
- ``live.py``: with ``--live-page``, ``GET /live`` (the page), ``/live/snapshot``, ``/live/events``

Each handler reads as the request's path: parse (``parse_*``: the protocol model to engine inputs,
or an OpenAI-shaped 4xx), the engine call (``serving.submit_all``, then ``collect`` or a stream),
shape (``*_response`` for one JSON body, ``*_sse`` for the Server-Sent Events of a stream). The
handlers get the server's state as a parameter (``state: State``, a FastAPI dependency), not from
a closure, so each piece can be called on its own.

The handlers carry no docstring on purpose: FastAPI would publish it as the operation's
description in ``/openapi.json``. What each returns is the ``responses=`` of its decorator (also
the schema) and the docstrings of the functions it calls.
"""
