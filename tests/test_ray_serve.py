"""engine.ray on a local Ray cluster of two nodes (two raylets on this host,
sharing its /dev/shm, listening on 127.0.0.1): one engine per node serves
every replica of that node, over HTTP (an Open Inference Protocol body) and
through the handle; the model's module reaches the nodes in the job's
runtime_env (working_dir); a killed node engine is restarted while the other
node serves on; nothing is left once the application is deleted or Serve
shut down.

One cluster and one application serve the whole module (a cluster takes
seconds to start). Each replica takes at most MAX_ONGOING requests at once,
so a batch of more than MAX_ONGOING holds two replicas' requests."""
import asyncio
import ipaddress
import json
import os
import pathlib
import signal
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import psutil
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
from ray.cluster_utils import Cluster  # noqa: E402

import engine  # noqa: E402
from engine.ray import deployment, engine_name  # noqa: E402
from engine.ray.owner import NAMESPACE, actor_name  # noqa: E402
from engine.segment import Segment  # noqa: E402
from engine.serving import metrics  # noqa: E402
from engine.shm import codes  # noqa: E402
from conftest import engine_word, unique_name, wait_for  # noqa: E402

ROOT = pathlib.Path(engine.__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"
SHAPE = (4,)
MAX_ONGOING = 4  # requests a replica takes at once
REPLICAS_PER_NODE = 2
# the model's module, only in the job's working_dir: 2x + 1, but a batch holding a
# negative value raises
MODEL = """
def load():
    def run(batch, lengths=None):
        if (batch < 0).any():
            raise ValueError("negative input")
        return batch * 2 + 1
    return run
"""
KNOBS = dict(backend="ray_served_model:load", input_shape=SHAPE, output_shape=SHAPE,
             max_batch_size=2 * MAX_ONGOING, max_delay_ms=300.0)
SUPERVISOR = "engine.ray.node_engine import _entry"
RUN_MARK = "SHMBATCH_TEST_RAY_RUN"  # in the environment of every process the cluster starts
WAIT_S = 60.0  # at most, for what Ray or Serve is asked
# at most, for what starts actors: Ray replaces a worker process that has not registered
# within 60 s (one that died starting, as seen under load), and only then
START_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_app(name: str, per_node: int = REPLICAS_PER_NODE):
    return deployment(name, engine=KNOBS, num_replicas=2 * per_node,
                      ray_actor_options={"num_cpus": 0, "resources": {"replica": 1}},
                      max_replicas_per_node=per_node, max_ongoing_requests=MAX_ONGOING,
                      health_check_period_s=1.0, graceful_shutdown_wait_loop_s=0.1)


def within(timeout_s: float, what: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), or TimeoutError if it has not returned within timeout_s."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args, **kwargs).result(timeout_s)
    except FutureTimeout:
        raise TimeoutError(f"not within {timeout_s} s: {what}") from None
    finally:
        pool.shutdown(wait=False)


def run(name: str, per_node: int = REPLICAS_PER_NODE) -> None:
    within(START_S, f"application {name} running", serve.run, replica_app(name, per_node),
           name=name, route_prefix=f"/{name}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The job's working_dir: the model's module, and nothing else."""
    folder = tmp_path_factory.mktemp("ray-app")
    (folder / "ray_served_model.py").write_text(MODEL)
    return folder


@pytest.fixture(scope="module")
def cluster(workdir):
    """Two nodes on 127.0.0.1, each with room for REPLICAS_PER_NODE replicas;
    the driver's job ships `workdir` to them; Serve's HTTP proxy on a free
    port of the head node."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", RUN_MARK)}
    # the nodes' workers import this engine (the tests' model comes in the working_dir)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([saved["PYTHONPATH"]]
                                                             if saved["PYTHONPATH"] else []))
    os.environ[RUN_MARK] = str(os.getpid())
    slots = {"replica": REPLICAS_PER_NODE + 1}  # room for one more application's replica
    c = Cluster(initialize_head=True, head_node_args={
        "node_ip_address": LOOPBACK, "num_cpus": 2, "resources": slots,
        "include_dashboard": False})
    try:
        c.add_node(node_ip_address=LOOPBACK, num_cpus=2, resources=slots)
        ray.init(address=c.address, runtime_env={"working_dir": str(workdir)},
                 log_to_driver=False, logging_level="WARNING")
        port = free_port()
        within(START_S, "Serve started", serve.start, proxy_location="HeadOnly",
               http_options={"host": LOOPBACK, "port": port})
        yield port
    finally:
        session = c.head_node.session_name if c.head_node is not None else None
        within(WAIT_S, "Serve shut down", serve.shutdown)
        ray.shutdown()
        c.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _reap_workers(session)


def _reap_workers(session) -> None:
    """Waits (bounded) for the cluster's worker processes to exit; kills any left."""
    if session is None:
        return
    mine = [p for p in psutil.process_iter(["cmdline"])
            if any(session in part for part in p.info["cmdline"] or ())]
    _, alive = psutil.wait_procs(mine, timeout=10)
    for p in alive:
        p.kill()


@pytest.fixture(scope="module")
def app(cluster):
    """The module's application, on both nodes: (name, HTTP port, its engines' names)."""
    name = unique_name("ray")
    run(name)
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    return name, cluster, [engine_name(name, name, node) for node in nodes]


def engines_of(prefix: str) -> list:
    return sorted(p.name[len("shmbatch-"):] for p in pathlib.Path("/dev/shm").glob(f"shmbatch-{prefix}-*"))


def supervisors() -> set:
    """The node engines' supervisors of this module's cluster, orphans included
    (other runs on this host have theirs)."""
    found = set()
    for p in psutil.process_iter(["cmdline"]):
        if any(SUPERVISOR in part for part in p.info["cmdline"] or ()):
            try:
                if p.environ().get(RUN_MARK) == str(os.getpid()):
                    found.add(p.pid)
            except psutil.Error:
                pass  # gone meanwhile
    return found


def stats(name: str) -> dict:
    seg = Segment.attach(name)
    try:
        return metrics.read_stats(seg)
    finally:
        seg.close()


def supervisor_pid(name: str) -> int:
    return engine_word(name, codes.W_SUPERVISOR_PID)


def owner_status(name: str) -> dict:
    return ray.get(ray.get_actor(actor_name(name), namespace=NAMESPACE).status.remote(),
                   timeout=WAIT_S)


def serving_owner(name: str) -> dict:
    """The status of the node's owner; {} while there is none (or it is ending)."""
    try:
        return owner_status(name)
    except (ValueError, ray.exceptions.RayActorError):
        return {}


def owner_exists(name: str) -> bool:
    try:
        ray.get_actor(actor_name(name), namespace=NAMESPACE)
        return True
    except ValueError:
        return False


def post(port: int, route: str, body: bytes, timeout_s: float = 30.0):
    """(status, headers, JSON answer) of a POST."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{route}", data=body,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def infer_body(rows: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": list(rows.shape),
                                   "data": rows.ravel().tolist()}]}).encode()


def requests(n: int, k: int = 1, start: int = 0) -> list:
    """n distinct requests of k rows each."""
    return [np.arange(k * SHAPE[0], dtype=np.float32).reshape(k, *SHAPE) + 100 * (start + i)
            for i in range(n)]


def through_handle(name: str, xs: list) -> list:
    """The answers to xs, sent at once through the application's handle."""
    async def send() -> list:
        handle = serve.get_app_handle(name)
        return await asyncio.wait_for(asyncio.gather(*(handle.infer.remote(x) for x in xs)),
                                      WAIT_S)
    return asyncio.run(send())


def listening_beyond_loopback() -> list:
    """(pid, process name, address) of each socket that this process, or one
    it started (every process of the cluster), serves on beyond loopback."""
    found = []
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            sockets = p.net_connections(kind="inet")
            name = p.name()
        except psutil.Error:
            continue  # gone meanwhile
        for s in sockets:
            ip = ipaddress.ip_address(s.laddr.ip)
            ip = getattr(ip, "ipv4_mapped", None) or ip
            udp_server = s.type == socket.SOCK_DGRAM and not s.raddr
            if (s.status == psutil.CONN_LISTEN or udp_server) and not ip.is_loopback:
                found.append((p.pid, name, ip))
    return found


def test_the_clusters_processes_listen_on_loopback_only_but_serves_replica_grpc_port(app):
    assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {LOOPBACK}
    beyond = listening_beyond_loopback()
    # Ray Serve binds each replica's inter-deployment gRPC server to [::]:0, fixed in
    # ray/serve/_private/replica.py: no option or environment variable reaches it
    replicas = [(pid, ip) for pid, name, ip in beyond if name.startswith("ray::ServeReplica:")]
    assert [b for b in beyond if not b[1].startswith("ray::ServeReplica:")] == []
    assert all(ip.is_unspecified for _, ip in replicas), replicas
    assert len({pid for pid, _ in replicas}) == len(replicas), replicas  # one port each


def test_replicas_run_on_both_nodes_each_node_served_by_exactly_one_engine(app):
    name, _, engines = app
    assert engines_of(name) == engines  # one engine per node, named after it
    assert [owner_status(e)["replicas"] for e in engines] == [REPLICAS_PER_NODE] * 2
    pids = {supervisor_pid(e) for e in engines}
    assert len(pids) == 2 and pids <= supervisors()


def test_every_answer_through_the_handle_is_its_own_requests(app):
    name = app[0]
    xs = [x[0] for x in requests(32)]
    ys = through_handle(name, xs)
    for x, y in zip(xs, ys):
        np.testing.assert_array_equal(y, x * 2 + 1)


def test_every_answer_over_http_is_its_own_requests(app):
    name, port, _ = app
    xs = requests(16, k=3)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda x: post(port, f"/{name}", infer_body(x)), xs))
    for x, (status, headers, body) in zip(xs, answers):
        assert status == 200, body
        # the answer of /v2/models/NAME/infer, as the README shows it
        assert body == {"model_name": name, "model_version": "1", "outputs": [
            {"name": "OUTPUT", "datatype": "FP32", "shape": [3, *SHAPE],
             "data": (x * 2 + 1).ravel().tolist()}]}


def test_the_route_answers_the_models_metadata_and_readiness(app):
    name, port, _ = app
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{name}", timeout=30) as r:
        metadata = json.loads(r.read())
    assert metadata["name"] == name and metadata["inputs"][0]["shape"] == [-1, *SHAPE]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{name}/ready", timeout=30) as r:
        assert json.loads(r.read()) == {"name": name, "ready": True}


def test_errors_map_to_the_protocols_statuses_and_to_the_engines_exceptions(app):
    name, port, _ = app
    handle = serve.get_app_handle(name)
    row = np.ones(SHAPE, np.float32)

    def over_http(rows, **parameters):
        body = json.loads(infer_body(rows))
        body["parameters"] = parameters
        status, _, answer = post(port, f"/{name}", json.dumps(body).encode())
        return status, answer["error"]

    status, error = over_http(np.ones((1, 5), np.float32))
    assert status == 400 and "expected shape" in error
    with pytest.raises(engine.InvalidInput):
        handle.infer.remote(np.ones(5, np.float32)).result(timeout_s=30)
    assert over_http(-row[None]) == (500, "BackendError: ValueError: negative input")
    with pytest.raises(engine.BackendError) as raised:
        handle.infer.remote(-row).result(timeout_s=30)
    assert (raised.value.exc_type, raised.value.message) == ("ValueError", "negative input")
    # a lone request waits max_delay_ms for its batch: past a 1 ms timeout
    status, error = over_http(row[None], timeout=1000)
    assert (status, error.split(":")[0]) in ((504, "RequestTimeout"), (503, "Overloaded")), error
    with pytest.raises((engine.RequestTimeout, engine.Overloaded)):
        handle.infer.remote(row, timeout_s=0.001).result(timeout_s=30)


def test_a_batch_mixes_the_requests_of_two_replicas_of_a_node(app):
    name, _, engines = app
    mixed = set()  # the engines that made a batch of more than MAX_ONGOING requests
    n = 4 * MAX_ONGOING * REPLICAS_PER_NODE

    def round_of_requests(start: int) -> bool:
        before = [stats(e)["batch_size_counts"] for e in engines]
        xs = [x[0] for x in requests(n, start=start)]
        for x, y in zip(xs, through_handle(name, xs)):
            np.testing.assert_array_equal(y, x * 2 + 1)
        for e, seen in zip(engines, before):
            new = [size for size, k in stats(e)["batch_size_counts"].items()
                   if k > seen.get(size, 0)]
            if max(new, default=0) > MAX_ONGOING:  # a replica holds MAX_ONGOING at most
                mixed.add(e)
        return mixed == set(engines)

    # a batch fills only with the requests that come within max_delay_ms: on a loaded
    # machine a round may come slower, and the next one is sent
    starts = iter(range(10 ** 4, 10 ** 6, n))
    wait_for(lambda: round_of_requests(next(starts)), "a batch of two replicas' requests on "
             "each node", timeout_s=WAIT_S, every_s=0)


def test_each_replica_reports_its_node_engines_queue_wait(app):
    name = app[0]
    handle = serve.get_app_handle(name)
    reported = handle.record_autoscaling_stats.remote().result(timeout_s=30)
    assert set(reported) == {"queue_wait_ms", "predicted_wait_ms"}
    assert all(isinstance(v, float) and v >= 0 for v in reported.values())


def test_a_killed_node_engine_answers_503_then_serves_again_while_the_other_serves_on(app):
    name, port, (dying, living) = app
    old_pid = supervisor_pid(dying)
    os.kill(old_pid, signal.SIGKILL)
    seen = {"refused": 0, "served_meanwhile": 0, "served_again": 0}

    def burst(start: int) -> None:
        xs = requests(8, start=start)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda x: post(port, f"/{name}", infer_body(x)), xs))
        for x, (status, headers, body) in zip(xs, answers):
            by = headers["shmbatch-engine"]
            if status == 503:
                assert by == dying and "EngineUnavailable" in body["error"], body
                seen["refused"] += 1
                continue
            assert status == 200, body
            np.testing.assert_array_equal(
                np.array(body["outputs"][0]["data"], np.float32).reshape(1, *SHAPE), x * 2 + 1)
            if by == living and seen["refused"] and not seen["served_again"]:
                seen["served_meanwhile"] += 1
            if by == dying and seen["refused"]:
                seen["served_again"] += 1

    starts = iter(range(1000, 10 ** 6, 8))
    wait_for(lambda: burst(next(starts)) or seen["served_again"],
             "the killed engine's replicas to serve again", timeout_s=60, every_s=0.01)
    assert seen["refused"] and seen["served_meanwhile"], seen
    assert supervisor_pid(dying) != old_pid and owner_status(dying)["restarts"] == 1
    assert engines_of(name) == sorted([dying, living])


def test_a_killed_owner_is_replaced_and_its_nodes_replicas_serve_again(app):
    name, port, (_, node_engine) = app
    old_pid = supervisor_pid(node_engine)
    ray.kill(ray.get_actor(actor_name(node_engine), namespace=NAMESPACE), no_restart=True)
    # the replicas' health checks attach to a new owner, which starts a new engine
    wait_for(lambda: serving_owner(node_engine) | {"supervisor_pid": 0} ==
             {"engine": node_engine, "state": "running", "replicas": REPLICAS_PER_NODE,
              "supervisor_pid": 0, "restarts": 0},
             "a new owner serving both replicas", timeout_s=START_S, every_s=0.1)
    assert supervisor_pid(node_engine) != old_pid and old_pid not in supervisors()
    xs = [x[0] for x in requests(16, start=5000)]
    for x, y in zip(xs, through_handle(name, xs)):
        np.testing.assert_array_equal(y, x * 2 + 1)
    assert len(supervisors()) == 2 and len(engines_of(name)) == 2


def test_nothing_is_left_after_serve_delete_or_serve_shutdown(app):
    name, _, engines = app
    other = unique_name("ray")
    run(other, per_node=1)
    others = engines_of(other)
    assert len(others) == 2 and not set(others) & set(engines)
    within(WAIT_S, f"serve.delete({name!r})", serve.delete, name)
    assert engines_of(name) == [] and len(supervisors()) == 2
    wait_for(lambda: not any(owner_exists(e) for e in engines), "the owners to end",
             timeout_s=30, every_s=0.05)
    within(WAIT_S, "serve.shutdown()", serve.shutdown)
    assert engines_of(other) == [] and supervisors() == set()
    wait_for(lambda: not any(owner_exists(e) for e in others), "the owners to end",
             timeout_s=30, every_s=0.05)
