"""An unmodified Resources server, written the way NeMo Gym writes one: the e2e tests' worker.

Plain Starlette with `SessionMiddleware`. `POST /seed_session` keeps a value in
this process's memory under a new session id, stored in the signed session
cookie and also handed out as an MCP session token (an itsdangerous
URLSafeSerializer payload). `POST /verify` returns the value of the session the
cookie names, or, when no cookie is sent, the one the token header names.
`POST /close_session` forgets it. A session this process does not hold is a 404:
that is what a misrouted request looks like.

It knows nothing of the router: no control socket, no claims, no episode
tokens. The secret key comes from the environment. Run one process per port:

    python -m uvicorn tests.e2e.starlette_app:create_app --factory --app-dir . \
        --host 127.0.0.1 --port PORT --workers 1
"""

from __future__ import annotations

import os
import uuid

from itsdangerous import BadSignature, URLSafeSerializer
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

SECRET_ENV = "RESOURCES_SESSION_SECRET"
SESSION_COOKIE = "ResourcesServer___resources"
SESSION_FIELD = "session_id"
TOKEN_HEADER = "X-NeMo-Gym-Session-Token"
TOKEN_SALT = "nemo-gym-mcp-session-token"
TOKEN_FIELD = "sid"

_values: dict[str, object] = {}  # session id → value: this process's memory, and only its own


def create_app() -> Starlette:
    """The app, keyed with the secret in SECRET_ENV; KeyError when it is not set."""
    secret = os.environ[SECRET_ENV]
    serializer = URLSafeSerializer(secret, salt=TOKEN_SALT)

    async def seed_session(request: Request) -> JSONResponse:
        body = await _json_object(request)
        if body is None:
            return JSONResponse({"error": "expected a JSON object"}, status_code=400)
        session_id = uuid.uuid4().hex
        _values[session_id] = body.get("value")
        request.session[SESSION_FIELD] = session_id
        token = serializer.dumps({TOKEN_FIELD: session_id})
        return JSONResponse(
            {
                "session_id": session_id,
                "worker": os.getpid(),
                "mcp": {"headers": {TOKEN_HEADER: token}},
            }
        )

    def session_id_of(request: Request) -> str | None:
        if SESSION_COOKIE in request.cookies:  # an unreadable cookie reads as an empty session
            found = request.session.get(SESSION_FIELD)
            return found if isinstance(found, str) else None
        token = request.headers.get(TOKEN_HEADER)
        if token is None:
            return None
        try:
            payload = serializer.loads(token)
        except BadSignature:
            return None
        found = payload.get(TOKEN_FIELD) if isinstance(payload, dict) else None
        return found if isinstance(found, str) else None

    async def verify(request: Request) -> JSONResponse:
        session_id = session_id_of(request)
        if session_id is None or session_id not in _values:
            return _not_here()
        value = _values[session_id]
        return JSONResponse({"session_id": session_id, "worker": os.getpid(), "value": value})

    async def close_session(request: Request) -> JSONResponse:
        session_id = session_id_of(request)
        if session_id is None or session_id not in _values:
            return _not_here()
        del _values[session_id]
        request.session.clear()
        return JSONResponse({"closed": session_id, "worker": os.getpid()})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True, "worker": os.getpid()})

    return Starlette(
        routes=[
            Route("/seed_session", seed_session, methods=["POST"]),
            Route("/verify", verify, methods=["POST"]),
            Route("/close_session", close_session, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        middleware=[
            Middleware(SessionMiddleware, secret_key=secret, session_cookie=SESSION_COOKIE)
        ],
    )


async def _json_object(request: Request) -> dict[str, object] | None:
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _not_here() -> JSONResponse:
    return JSONResponse({"error": "no such session here"}, status_code=404)
