"""Who may call the server: vLLM's ``--api-key``.

Without a key (the default) anyone who can reach the port may generate, which is fine on
127.0.0.1, the default address. With one (``python -m infer.server --api-key KEY``, or the
environment variable ``INFER_API_KEY``), the API's routes answer only requests carrying the
header ``Authorization: Bearer KEY`` (what the ``openai`` client sends for its ``api_key``);
anything else gets a 401 in OpenAI's error body (``code: invalid_api_key``) before the handler
runs. ``/health`` and ``/metrics`` stay open, as in vLLM: load balancers and Prometheus call
them without credentials, and they reveal no prompt or output.

The check is a FastAPI dependency, :func:`api_key_dependency`, that ``build_app`` attaches to
the routers it protects (``include_router(..., dependencies=[...])``), so no handler repeats it.
Its ``HTTPBearer`` parameter makes FastAPI declare the bearer scheme in ``/openapi.json`` for
exactly those routes. The key is compared with ``secrets.compare_digest``, whose time does not
depend on where the first differing byte is: a plain ``==`` returns sooner the earlier a guess
goes wrong, and timing many guesses would reveal the key a byte at a time.
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends
from fastapi.params import Depends as DependsParam
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from infer.server.responses import Reject, error_response

# auto_error=False: a missing or malformed header reaches the check (FastAPI's own answer would be
# a 403 in its own body), which answers OpenAI's 401
_bearer = HTTPBearer(auto_error=False, description="The server's API key (`--api-key`)")


def unauthorized(message: str) -> Reject:
    """A 401 in OpenAI's error body, with the ``WWW-Authenticate: Bearer`` header HTTP asks of a 401."""
    response = error_response(401, message, None, "invalid_request_error", "invalid_api_key")
    response.headers["WWW-Authenticate"] = "Bearer"
    return Reject(response)


def api_key_dependency(api_key: str) -> DependsParam:
    """The dependency that lets a request through only with ``Authorization: Bearer <api_key>``.

    Raises (in the request):
        Reject: 401 ``invalid_api_key`` when the header is missing, not a bearer token, or holds
            another key.
    """
    expected = api_key.encode()

    async def check_api_key(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
        if credentials is None:
            raise unauthorized("this server needs an API key: send it as the header 'Authorization: Bearer <key>'")
        if not secrets.compare_digest(credentials.credentials.encode(), expected):
            raise unauthorized("incorrect API key")

    return Depends(check_api_key)
