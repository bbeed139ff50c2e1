"""Which gateway holds a session (pure code): its resume token names it, so a `session.resume` that a load
balancer hands to another gateway is answered with a coded redirect there (docs/deploy.md, "Several gateways").

A session cannot move: its Triton stream and its journal live in the gateway process that opened it. The token
is `<the holder's URL, base64url>.<secret>` when the gateway knows its own URL (`MINICPMO_GATEWAY_URL`), the
secret alone otherwise (one gateway). Any gateway reads the holder off the token without a shared table; the
holder alone checks the secret. A token that names no other gateway gets `session_resume_expired` as before.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from urllib.parse import urlsplit

from .codes import ClientCode
from .wire import CLOSE_TRY_AGAIN, ProtocolError

SCHEMES = ("ws", "wss")


def check_url(url: str) -> str:
    """A gateway's own URL as it is configured: ws:// or wss:// with a host; ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES or not parts.netloc:
        raise ValueError(f"MINICPMO_GATEWAY_URL must be ws://host:port or wss://host:port, not {url!r}")
    return url.rstrip("/")


def new_token(gateway_url: str) -> str:
    secret = secrets.token_urlsafe(24)
    if not gateway_url:
        return secret
    return f"{base64.urlsafe_b64encode(gateway_url.encode()).decode().rstrip('=')}.{secret}"


def holder(token: object) -> str | None:
    """The gateway URL a token names, if it names one."""
    if not isinstance(token, str) or "." not in token:
        return None
    name = token.split(".", 1)[0]
    try:
        url = base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)).decode()
        return check_url(url)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def redirect(token: object, gateway_url: str, path: str) -> ProtocolError | None:
    """The answer to a resume of a session this gateway does not hold: a redirect to the gateway the token
    names, when that is another one (`path`: the route the resume came in on, kept)."""
    url = holder(token)
    if url is None or url == gateway_url.rstrip("/"):
        return None
    err = ProtocolError(ClientCode.SESSION_ELSEWHERE,
                        f"the session is held by another gateway: resume it at {url}{path}",
                        "resume_token", close_code=CLOSE_TRY_AGAIN, error_type="invalid_request_error",
                        retryable=True)
    err.redirect_url = url + path
    return err
