"""API-key check (``--api-key``): ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key:
<key>``) on every route but the public ones, compared in constant time so response timing says
nothing about the key."""

from __future__ import annotations

import hmac

from aiohttp import web

from tidal.frontend.server.errors import APIError

# Probes and scrapers must work without the key (load balancers, Prometheus, routers
# polling /load).
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/load"})


def check_api_key(request: web.Request, expected: bytes) -> None:
    if request.path in PUBLIC_PATHS:
        return
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        # Anthropic's clients send the key as x-api-key.
        scheme, token = "bearer", request.headers.get("x-api-key", "")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>' "
                       "(or 'x-api-key: <key>')", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), expected):
        raise APIError(401, "invalid API key: check the key this server was started with "
                       "(--api-key)", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
