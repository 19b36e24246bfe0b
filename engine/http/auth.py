"""Who may call the HTTP port: the API key every route but the health probes needs, when set.

With `serve --api-key KEY` (or SHMBATCH_API_KEY), a request needs
`Authorization: Bearer KEY`, which the openai client sends from its
api_key. The front checks it before it routes the request, so no route
reads a body it refuses. The presented token is compared with the key in
constant time (hmac.compare_digest, on bytes). The health routes (HEALTH)
need no key: a kubelet's or a gateway's probe carries none, and they say
nothing but whether the engines serve. A refusal names what was expected
and what came, never the token that came: a caller that mistyped the key
may have sent another secret.
"""
import hmac
from typing import Optional

from engine.http.asgi import Scope

ENV = "SHMBATCH_API_KEY"
HEALTH = frozenset(("/health", "/v2/health/live", "/v2/health/ready"))
CHALLENGE = (b"www-authenticate", b"Bearer")
EXPECTED = "expected an Authorization: Bearer header with this server's API key"


def checked(key: str) -> str:
    """key, if it can travel in a header as a Bearer token: ValueError
    otherwise, which says what the key is made of, never the key."""
    if not key or not all("!" <= c <= "~" for c in key):
        raise ValueError(f"--api-key (or {ENV}): expected one or more visible ASCII characters "
                         f"(no space), got {len(key)} character(s)"
                         + (", some of them others" if key else ""))
    return key


class ApiKey:
    """The one key a request must present (checked() already)."""

    def __init__(self, key: str) -> None:
        self._key = checked(key).encode("ascii")

    def __repr__(self) -> str:  # never the key, wherever the object is printed
        return "ApiKey(...)"

    def refusal(self, scope: Scope) -> Optional[str]:
        """None when the request may go on, else why not (for its 401)."""
        if scope["path"] in HEALTH:
            return None
        values = [value for name, value in scope["headers"] if name == b"authorization"]
        if not values:
            return f"{EXPECTED}, got no Authorization header"
        if len(values) > 1:
            return f"{EXPECTED}, got {len(values)} Authorization headers"
        scheme, _, token = values[0].strip().partition(b" ")
        if scheme.lower() != b"bearer":  # the scheme is case-insensitive (RFC 9110)
            return f"{EXPECTED}, got an Authorization header of another scheme"
        if not hmac.compare_digest(token.strip(), self._key):
            return f"{EXPECTED}, got a Bearer token that is not this server's key"
        return None
