"""Who may call what, when ``api_keys`` is set (with none set, every route is open).

- ``GET /healthz``, ``GET /readyz``: no key (liveness and readiness probes);
- ``GET`` (or ``HEAD``) ``/metrics``, ``/turn``, ``/turn/log``, ``/turn/history``,
  ``/status`` (and ``/status/batches``), ``/v1/models``, ``/batch/v1/models``,
  ``/openapi.json``, ``/docs``, ``/redoc``:
  any key, role ``read`` or ``user`` (dashboards, Prometheus' scrape);
- everything else (the completion routes, and unknown routes): a ``user`` key.

A key comes as ``Authorization: Bearer KEY``, or as the password of HTTP Basic
credentials (a 401 asks for either, so a browser prompts for ``/status``). Keys
are compared in constant time (:func:`hmac.compare_digest`), every
configured key each time, so the time taken does not tell how much of a key was
right. Which class a key may use, and whether it may choose it by header, is its
policy (:class:`proxy.config.ApiKey`); see :func:`may_override`.

A key without the ``batch`` class may not use the Batch API at all: ``/batch/v1/...``,
``/v1/batches...`` and ``/v1/files...`` answer it 403 (:func:`batch_path`), as the
interactive routes answer a key without ``interactive`` (:mod:`proxy.api.inputs`).

Each request is for a tenant (:class:`proxy.config.Tenant`): a configured key's
(:func:`caller_tenant`); with no ``api_keys``, one per distinct key sent
(``key-`` and the start of its SHA-256), else one per client address
(``addr-HOST``). The key itself is never logged; the tenant may be.

The key is checked once per request, as it comes in (:class:`KeyCheck`); what a
route needs of it later (a completion route's class, :mod:`proxy.api.inputs`; the
tenant) it reads from the :class:`Caller` the check leaves in the request's scope.
"""

from __future__ import annotations

import base64
import hmac
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.config import ANONYMOUS, ApiKey, Settings, Tenant, key_tenant_name
from proxy.openai.errors import APIError

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
READ_PATHS = frozenset(
    {
        "/metrics",
        "/turn",
        "/turn/log",
        "/turn/history",
        "/status",
        "/status/batches",
        "/v1/models",
        "/batch/v1/models",
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
    }
)


CHALLENGE = 'Bearer realm="whoseturn", Basic realm="whoseturn"'
BATCH_ROOTS = ("/batch/v1", "/v1/batches", "/v1/files")
"""The Batch API's paths (each, and everything under it): a key without the batch
class gets 403 there."""


def batch_path(path: str) -> bool:
    """Whether ``path`` is one of the Batch API's (:data:`BATCH_ROOTS`)."""
    return any(path == root or path.startswith(root + "/") for root in BATCH_ROOTS)


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key in ``Authorization: Bearer KEY``, or the password of HTTP Basic
    credentials (so that a browser can open ``/status`` and the API docs)."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "basic":
                return _basic_password(token.strip())
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def _basic_password(token: str) -> str | None:
    try:
        _, _, password = base64.b64decode(token, validate=True).decode("utf-8").partition(":")
    except ValueError:
        return None
    return password or None


def same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode("utf-8"), b.encode("utf-8"))


def find_key(settings: Settings, token: str | None) -> ApiKey | None:
    """The configured key equal to ``token``; every key is compared."""
    found = None
    for key in settings.access.key_policies():
        if same(key.key, token or "") and token:
            found = key
    return found


def needed_role(method: str, path: str) -> str | None:
    """``None`` (no key), ``read`` (any key) or ``user`` for ``method path``."""
    if path in OPEN_PATHS:
        return None
    if method in ("GET", "HEAD") and path in READ_PATHS:
        return "read"
    return "user"


def may_override(settings: Settings, token: str | None, key: ApiKey | None) -> bool:
    """Whether this caller may choose its class by ``X-Whoseturn-Class``:
    ``class_override`` true or false says so for everyone, a list names the keys;
    unset, anyone may without ``api_keys``, and with them a key whose policy allows."""
    allowed = settings.access.class_override
    if isinstance(allowed, tuple):
        return token is not None and any([same(token, k) for k in allowed])
    if allowed is not None:
        return allowed
    return not settings.access.api_keys or (key is not None and key.class_override)


def unauthorized() -> APIError:
    return APIError(401, "Invalid or missing API key.", err_type="authentication_error")


CALLER = "caller"
"""Where :class:`KeyCheck` keeps the :class:`Caller` in the ASGI scope's state."""


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as :class:`KeyCheck` found it once, as the request came
    in: ``key``, the configured key it gave (None: no ``api_keys``, or a path that
    needs no key); ``may_override``, whether it may choose its class by
    ``X-Whoseturn-Class`` (:func:`may_override`); ``tenant``, whom it is for
    (:func:`caller_tenant`)."""

    key: ApiKey | None
    may_override: bool
    tenant: Tenant = ANONYMOUS


def caller_tenant(
    settings: Settings, scope: Scope, token: str | None, key: ApiKey | None
) -> Tenant:
    """The tenant of a request: its configured key's; with no ``api_keys``, one per
    key sent (``key-`` and a hash: the name tells nothing of the key) or, with none,
    one per client address (``addr-HOST``), each of weight 1 with no limits. A path
    that needs no key, with ``api_keys`` set, and a client of no known address (a
    Unix socket's) are anonymous (``""``)."""
    if key is not None:
        return settings.access.tenant(key.tenant)
    if settings.access.api_keys:
        return ANONYMOUS
    if token:
        return Tenant(name=key_tenant_name(token))
    client = scope.get("client")
    host = client[0] if client else ""
    return Tenant(name=f"addr-{host}") if host else ANONYMOUS


def caller(scope: Scope) -> Caller:
    """The request's :class:`Caller`, as :class:`KeyCheck` left it."""
    found = scope.get("state", {}).get(CALLER)
    if not isinstance(found, Caller):
        raise RuntimeError("the request did not pass the key check (KeyCheck)")
    return found


def check_key(settings: Settings, scope: Scope) -> Caller | APIError:
    """The caller of the HTTP request ``scope``, or why it is refused (401, 403)."""
    path = scope["path"]
    role = needed_role(scope["method"], path)
    token = bearer_token(scope.get("headers", []))
    key = None
    if role is not None and settings.access.api_keys:
        key = find_key(settings, token)
        if key is None:
            return unauthorized()
        if role == "user" and key.role != "user":
            return APIError(403, "This API key may only read.", err_type="permission_error")
        if "batch" not in key.classes and batch_path(path):
            return no_class("batch")
    tenant = caller_tenant(settings, scope, token, key)
    return Caller(key, may_override(settings, token, key), tenant)


def no_class(cls: str) -> APIError:
    """403: the caller's key may not use class ``cls``."""
    return APIError(403, f"This API key may not use the {cls} class.", err_type="permission_error")


class KeyCheck:
    """ASGI middleware: each route behind the key role it needs (table above). The
    key is looked up once per request (:func:`check_key`); the routes that need it
    again (a completion route's class) read the :class:`Caller` it leaves
    (:func:`caller`)."""

    def __init__(self, app: ASGIApp, *, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        checked = check_key(self.settings, scope)
        if isinstance(checked, Caller):
            scope.setdefault("state", {})[CALLER] = checked
            await self.app(scope, receive, send)
            return
        headers = {"www-authenticate": CHALLENGE} if checked.status == 401 else {}
        await checked.response(headers)(scope, receive, send)
