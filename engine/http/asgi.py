"""The ASGI interface the front is written against, its types named once.

An app is called with a connection's scope and two coroutines: receive()
gives the request's messages (its body, then `http.disconnect` once the
caller is gone), send() writes the response's. Each protocol's routes, the
events of a stream and the server's connections speak only these.
"""
from typing import Any, Awaitable, Callable, Iterable, List, MutableMapping, Optional, Tuple

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = Iterable[Tuple[bytes, bytes]]
# a request answered from its whole body, without the ASGI messages (the
# front's whole(scope), where the server has it): (status, body, headers);
# the server writes the head, with the body's length, and the body
WholeAnswer = Callable[[bytes], Awaitable[Tuple[int, bytes, List[Tuple[bytes, bytes]]]]]

# scope["extensions"][WRITE_BODY], where the server has it: write_body(body) ->
# bool, the next bytes of a streamed response's body written at once, as send
# would, when the connection takes them now; False: send them instead
WRITE_BODY = "shmbatch.write_body"
JSON = (b"content-type", b"application/json")


def header(scope: Scope, name: bytes) -> Optional[str]:
    """The request's header `name` (lower case), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def send_whole(send: Send, status: int, body: bytes, headers: Headers = (JSON,)) -> None:
    """A whole response: its head, saying its length, then its body."""
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
