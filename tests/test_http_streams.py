"""Generate over HTTP: an answer says how it ended, and a caller that leaves,
stops reading or is cut off by a shutdown never holds a slot nor gets an
answer that looks complete."""
import http.client
import json
import signal
import socket

import pytest

pytest.importorskip("uvicorn")
from conftest import requests_total, unique_name, wait_for  # noqa: E402
from test_multi_engine import Served, table, top  # noqa: E402


STEPS = dict(input_shape=[2], input_dtype="int64", output_shape=[], output_dtype="int64")
WIDTH = 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    names = {tag: unique_name(tag) for tag in ("gen", "long", "wide")}
    tables = [
        table(names["gen"], backend="serve_backends:counting", iterative=True, max_steps=64,
              **STEPS),
        # one slot: a request that holds it shows as 503 QueueFull to the next
        table(names["long"], backend="serve_backends:counting", backend_args={"step_ms": 10.0},
              iterative=True, max_steps=65536, queue_capacity=1, max_batch_size=1, **STEPS),
        table(names["wide"], backend="serve_backends:wide",
              backend_args={"width": WIDTH, "step_ms": 1.0}, iterative=True, max_steps=2048,
              queue_capacity=1, max_batch_size=1, input_shape=[2], input_dtype="int64",
              output_shape=[WIDTH], output_dtype="float64"),
    ]
    served = Served(tmp_path_factory.mktemp("streams"), top(http_workers=1) + "".join(tables),
                    "--http-port", "0")
    served.names = names
    yield served
    served.stop()


def request(url: str, path: str, body: dict, timeout_s: float = 60):
    """(status, the response's JSON) of one POST."""
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", path, body=json.dumps(body).encode())
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def events(url: str, path: str, body: dict) -> list:
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode())
        response = conn.getresponse()
        assert response.status == 200
        text = response.read().decode()
        return [json.loads(e[len("data: "):]) for e in text.split("\n\n") if e]
    finally:
        conn.close()


def raw_post(url: str, path: str, body: dict) -> socket.socket:
    """A POST sent on a socket of its own, its answer left unread."""
    host, port = url.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
                 f"\r\n".encode() + data)
    return sock



def slot_comes_back(url: str, name: str, within_s: float = 60) -> None:
    """A short request to a one-slot engine is answered once the slot is free."""
    def answered() -> bool:
        status, body = request(url, f"/v2/models/{name}/generate", {"INPUT": [0, 3]})
        assert status in (200, 503), body  # 503: QueueFull while the slot is held
        return status == 200 and len(body["OUTPUT"]) == 3

    wait_for(answered, f"the one slot of {name} free again", within_s)


def test_the_last_chunk_event_says_the_model_finished_the_answer(server):
    got = events(server.url, f"/v2/models/{server.names['gen']}/generate_stream",
                 {"INPUT": [7, 4]})
    assert [e["OUTPUT"] for e in got] == [7, 8, 9, 10]
    assert [e.get("finish_reason") for e in got] == [None, None, None, "stop"]


def test_the_last_chunk_event_says_the_answer_reached_its_max_steps(server):
    got = events(server.url, f"/v2/models/{server.names['gen']}/generate_stream",
                 {"INPUT": [7, 10], "parameters": {"max_steps": 2}})
    assert [(e["OUTPUT"], e.get("finish_reason")) for e in got] == [(7, None), (8, "length")]


def test_a_whole_answer_says_how_it_finished(server):
    path = f"/v2/models/{server.names['gen']}/generate"
    assert request(server.url, path, {"INPUT": [1, 2]})[1]["finish_reason"] == "stop"
    done = request(server.url, path, {"INPUT": [1, 9], "parameters": {"max_steps": 3}})[1]
    assert (done["OUTPUT"], done["finish_reason"]) == ([1, 2, 3], "length")


def test_a_generate_whose_caller_disconnects_is_withdrawn(server):
    name = server.names["long"]
    # endless: 65536 steps of 10 ms hold the one slot for minutes unless withdrawn
    sock = raw_post(server.url, f"/v2/models/{name}/generate",
                    {"INPUT": [0, 0], "parameters": {"timeout": 600_000_000}})
    try:
        wait_for(lambda: request(server.url, f"/v2/models/{name}/generate",
                                 {"INPUT": [0, 1]})[0] == 503, "the first request running")
    finally:
        sock.close()
    slot_comes_back(server.url, name)


def test_a_stream_whose_caller_stops_reading_loses_its_slot_at_its_timeout(server):
    name = server.names["wide"]
    # each event is ~13 KB: the socket buffers fill long before 2048 steps end
    sock = raw_post(server.url, f"/v2/models/{name}/generate_stream",
                    {"INPUT": [0, 0], "parameters": {"timeout": 3_000_000}})
    try:
        slot_comes_back(server.url, name)
    finally:
        sock.close()


def test_a_generate_in_flight_when_the_server_stops_gets_a_json_error(tmp_path):
    name = unique_name("stopping")
    served = Served(tmp_path, top(http_workers=1) + table(
        name, backend="serve_backends:counting", backend_args={"step_ms": 10.0},
        iterative=True, max_steps=65536, drain_timeout_s=1.0, **STEPS), "--http-port", "0")
    try:
        host, port = served.url.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", f"/v2/models/{name}/generate",
                     body=json.dumps({"INPUT": [0, 0],
                                      "parameters": {"timeout": 600_000_000}}).encode())
        # in flight: enqueued (its answer is minutes away), then serve is stopped
        wait_for(lambda: requests_total(name) == 1, "the request enqueued", 60)
        served.proc.send_signal(signal.SIGTERM)
        response = conn.getresponse()
        body = json.loads(response.read())
        assert response.status == 503
        assert "shutting down" in body["error"]
    finally:
        served.stop()
