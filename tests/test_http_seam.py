"""The seam between the HTTP worker's connections and uvicorn's internals
(engine.http.server.connections and .writes, the modules that reach into them)
holds on the uvicorn installed: each name and behaviour it relies on is
there. A uvicorn release that moves one fails here, by name, before any
connection misbehaves; the `http` extra pins the releases tested."""
import asyncio
import inspect

import pytest

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httptools")

from uvicorn.protocols.http import httptools_impl  # noqa: E402

from engine.http.asgi import WRITE_BODY  # noqa: E402
from engine.http.server import connections, writes  # noqa: E402


class Transport(asyncio.Transport):
    """A socket's transport that keeps what is written."""

    def __init__(self) -> None:
        super().__init__()
        self.written, self.closed = [], False

    def write(self, data) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(
            name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def write_eof(self) -> None:
        pass


def _connection(app, guard):
    config = uvicorn.Config(app, http=connections.protocol(guard), lifespan="off",
                            log_level="warning")
    config.load()
    state = uvicorn.server.ServerState()
    protocol = config.http_protocol_class(config=config, server_state=state, app_state={},
                                          _loop=asyncio.get_running_loop())
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport


def test_the_protocol_subclassed_is_uvicorns_httptools_one_with_its_hooks():
    base = httptools_impl.HttpToolsProtocol
    assert issubclass(connections.GuardedProtocol, base)
    hooks = ("connection_made", "data_received", "connection_lost", "on_message_begin",
             "on_headers_complete", "on_body", "on_message_complete")
    assert all(callable(getattr(base, hook, None)) for hook in hooks)
    assert list(inspect.signature(base.__init__).parameters)[1:4] == [
        "config", "server_state", "app_state"]
    assert all(isinstance(line, bytes) and line.startswith(b"HTTP/1.1 %d" % status)
               for status, line in ((s, httptools_impl.STATUS_LINE[s]) for s in (408, 503)))


def test_the_server_keeps_its_listeners_and_shuts_down_with_sockets():
    assert "sockets" in inspect.signature(uvicorn.Server.shutdown).parameters
    assert "self.servers" in inspect.getsource(uvicorn.Server.startup)  # what shutdown closes


def test_a_request_reaches_the_app_through_the_held_head_and_the_body_writer():
    seen = {}

    async def app(scope, receive, send):
        seen["write_body"] = scope["extensions"][WRITE_BODY]
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
        seen["answered"].set()

    async def main():
        seen["answered"] = asyncio.Event()
        guard = connections.Guard(read_timeout_s=5.0, max_connections=8)
        protocol, transport = _connection(app, guard)
        protocol.data_received(b"GET /x HTTP/1.1\r\nhost: a\r\n\r\n")
        cycle = protocol.cycle
        # what HeadWithBody and the read timeout read of uvicorn's cycle and protocol
        for name in ("send", "transport", "flow", "disconnected", "message_event",
                     "response_started", "response_complete", "chunked_encoding"):
            assert hasattr(cycle, name), name
        assert isinstance(cycle.send, writes.HeadWithBody)
        for name in ("connections", "loop", "transport", "flow", "scope"):
            assert hasattr(protocol, name), name
        assert hasattr(protocol.flow, "read_paused") and hasattr(cycle.flow, "write_paused")
        await asyncio.wait_for(seen["answered"].wait(), 5)
        assert cycle.response_complete
        protocol.connection_lost(None)
        return transport.written

    written = asyncio.run(asyncio.wait_for(main(), 10))
    assert len(written) == 1, written  # the head held and written with the body, in one write
    assert written[0].startswith(b"HTTP/1.1 200") and written[0].endswith(b"\r\n\r\nok")
    assert callable(seen["write_body"])


def test_a_connection_over_the_cap_is_answered_503_and_closed():
    async def main():
        guard = connections.Guard(read_timeout_s=5.0, max_connections=0)
        protocol, transport = _connection(lambda *a: None, guard)
        protocol.connection_lost(None)
        return transport

    transport = asyncio.run(asyncio.wait_for(main(), 10))
    assert transport.written[0].startswith(b"HTTP/1.1 503")


def _whole_connection(answer):
    """A connection whose front takes POST /w whole, answered by answer(raw);
    the ASGI app must never run."""
    async def app(scope, receive, send):
        raise AssertionError(f"the app ran for {scope['path']}")

    def whole(scope):
        return answer if scope["path"] == "/w" else None
    return _connection(app, connections.Guard(read_timeout_s=5.0, max_connections=8,
                                              whole=whole))


async def _settled(protocol) -> None:
    """Until the connection's tasks have ended (bounded)."""
    await asyncio.wait_for(asyncio.gather(*protocol.tasks), 5)


def test_a_request_taken_whole_waits_for_its_body_then_is_answered_in_one_write():
    bodies = []

    async def answer(raw):
        bodies.append(raw)
        return 201, raw.upper(), [(b"content-type", b"text/plain")]

    async def main():
        protocol, transport = _whole_connection(answer)
        protocol.data_received(b"POST /w HTTP/1.1\r\nhost: a\r\ncontent-length: 5\r\n\r\nhe")
        await asyncio.sleep(0)  # a loop pass: the request's task runs, and waits for the body
        assert bodies == [] and len(protocol.tasks) == 1
        protocol.data_received(b"llo")
        await _settled(protocol)
        # what answer_whole reads and sets of uvicorn's cycle and protocol
        cycle = protocol.cycle
        for name in ("waiting_for_100_continue", "more_body", "body", "keep_alive",
                     "on_response", "message_event", "flow", "disconnected", "scope"):
            assert hasattr(cycle, name), name
        assert hasattr(protocol.server_state, "default_headers")
        assert cycle.response_complete and not transport.closed
        return transport.written

    written = asyncio.run(asyncio.wait_for(main(), 10))
    assert bodies == [b"hello"] and len(written) == 1, written
    head, _, body = written[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 201") and b"\r\ncontent-length: 5" in head
    assert b"\r\ncontent-type: text/plain" in head and body == b"HELLO"


def test_a_whole_answer_that_fails_is_uvicorns_500_and_the_connection_closes():
    async def answer(raw):
        raise RuntimeError("a fault of the front's own")

    async def main():
        protocol, transport = _whole_connection(answer)
        protocol.data_received(b"POST /w HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\n\r\n{}")
        await _settled(protocol)
        return transport

    transport = asyncio.run(asyncio.wait_for(main(), 10))
    assert transport.written[0].startswith(b"HTTP/1.1 500")
    assert transport.written[0].endswith(b"connection: close\r\ncontent-length: 21\r\n\r\n"
                                         b"Internal Server Error")
    assert transport.closed


def test_a_caller_gone_before_its_body_is_whole_gets_nothing_and_its_task_ends():
    async def answer(raw):
        raise AssertionError("answered without its body")

    async def main():
        protocol, transport = _whole_connection(answer)
        protocol.data_received(b"POST /w HTTP/1.1\r\nhost: a\r\ncontent-length: 9\r\n\r\n{")
        await asyncio.sleep(0)
        protocol.connection_lost(None)
        await _settled(protocol)
        return transport

    assert asyncio.run(asyncio.wait_for(main(), 10)).written == []


# how a connection ends while its whole answer is computed: its caller leaves,
# or uvicorn closes it for a later request's bad bytes (marking only that one)
ENDINGS = {"caller gone": lambda protocol, transport: protocol.connection_lost(None),
           "closed for a later request": lambda protocol, transport: transport.close()}


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_whole_answer_for_a_connection_ended_meanwhile_is_not_written(ending):
    async def main():
        gate = asyncio.Event()

        async def answer(raw):
            await gate.wait()
            return 200, b"late", []
        protocol, transport = _whole_connection(answer)
        protocol.data_received(b"POST /w HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\n\r\n{}")
        await asyncio.sleep(0)
        ENDINGS[ending](protocol, transport)
        gate.set()
        await _settled(protocol)
        return transport

    assert asyncio.run(asyncio.wait_for(main(), 10)).written == []
