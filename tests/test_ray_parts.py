"""engine.ray's parts that need no cluster: the engines' names, the queue
wait a replica reports, the policy that scales on it, the checks
deployment() makes, an engine error that travels back to a caller, and a
node engine whose owner died as it started."""
import os
import pathlib
import pickle
import types

import numpy as np
import psutil
import pytest

pytest.importorskip("ray.serve")

import engine  # noqa: E402
from engine.config import NAME_RE  # noqa: E402
from engine.ray import QueueWaitPolicy, deployment, engine_name  # noqa: E402
from engine.ray import node_engine  # noqa: E402
from engine.ray.replica import _Portable  # noqa: E402
from engine.ray.scaling import RecentQueueWait  # noqa: E402
from engine.segment import remove_if_dead  # noqa: E402
from engine.shm import liveness  # noqa: E402
from conftest import unique_name, wait_for  # noqa: E402

NODE_A, NODE_B = "a1" * 28, "b2" * 28  # Ray's node ids are 56 hex digits
KNOBS = dict(backend="engine.backends:identity", input_shape=(4,), output_shape=(4,))


def test_each_node_of_an_application_has_an_engine_name_of_its_own():
    names = {engine_name("digits", "digits", NODE_A), engine_name("digits", "digits", NODE_B),
             engine_name("other", "other", NODE_A), engine_name("digits", "second", NODE_A)}
    assert len(names) == 4 and all(NAME_RE.match(n) for n in names)


def test_a_long_or_odd_application_name_still_makes_a_valid_distinct_engine_name():
    long_a, long_b = "a" * 100 + "/x", "a" * 100 + "/y"
    a, b = engine_name(long_a, long_a, NODE_A), engine_name(long_b, long_b, NODE_A)
    assert a != b and NAME_RE.match(a) and NAME_RE.match(b)


def test_the_recent_queue_wait_counts_only_the_requests_dispatched_since_the_last_read():
    delay_ms = 50.0
    with engine.Engine(unique_name("qwait"), **KNOBS, max_batch_size=8, max_delay_ms=delay_ms) \
            as eng, engine.Client(eng.name) as c:
        wait = RecentQueueWait()
        c.infer(np.ones(4, np.float32))
        seg = c.attached
        # a batch's answers are published before it is counted
        wait_for(lambda: eng.stats()["batch_size_counts"] == {1: 1}, "the batch counted",
                 timeout_s=10)
        first = wait.read_ms(seg)
        assert first >= delay_ms  # alone, a request waits for its batch's deadline
        assert wait.read_ms(seg) == 0.0  # nothing dispatched since


def test_the_policy_sizes_the_replicas_to_the_target_queue_wait():
    def ctx(replicas, waits):
        return types.SimpleNamespace(current_num_replicas=replicas, target_num_replicas=replicas,
                                     aggregated_metrics={"queue_wait_ms": dict(enumerate(waits))})
    policy = QueueWaitPolicy(target_queue_wait_ms=20)
    assert policy(ctx(2, [50.0, 30.0]))[0] == 4  # 2 x 40 / 20
    assert policy(ctx(4, [5.0, 5.0, 5.0, 5.0]))[0] == 1
    assert policy(ctx(3, [21.0, 19.0, 21.0]))[0] == 3  # within 10 % of the target
    assert policy(ctx(3, []))[0] == 3  # nothing reported yet
    with pytest.raises(ValueError):
        QueueWaitPolicy(target_queue_wait_ms=0)


def test_deployment_checks_the_engines_settings_before_anything_is_deployed():
    with pytest.raises(TypeError, match="name"):
        deployment("d", engine={**KNOBS, "name": "x"})
    with pytest.raises(TypeError, match="max_batch"):
        deployment("d", engine={**KNOBS, "max_batch": 4})
    with pytest.raises(ValueError):
        deployment("d", engine={**KNOBS, "max_batch_size": 0})
    app = deployment("d", engine=KNOBS, num_replicas=3, max_ongoing_requests=7)
    options = app._bound_deployment  # what Serve will deploy
    assert options.num_replicas == 3 and options.max_ongoing_requests == 7


def test_a_backend_error_raised_in_a_replica_reaches_its_caller_as_a_backend_error():
    got = pickle.loads(pickle.dumps(_Portable("ValueError", "negative input")))
    assert type(got) is engine.BackendError
    assert (got.exc_type, got.message) == ("ValueError", "negative input")


def test_a_node_engine_whose_owner_died_as_it_started_starts_nothing(fork_ctx):
    # Ray kills an owner actor's children as it kills the actor, and the owner may
    # restart its supervisor meanwhile: that one must not serve on as an orphan
    name = unique_name("orphan")
    reader, writer = fork_ctx.Pipe(duplex=False)

    def owner() -> None:
        proc, _ = node_engine.spawn(name, KNOBS)
        writer.send(proc.pid)
        os._exit(0)  # long before the supervisor's interpreter has started

    dying = fork_ctx.Process(target=owner)
    dying.start()
    assert reader.poll(30), "the owner did not spawn its supervisor"
    pid = reader.recv()
    dying.join(30)
    try:
        wait_for(lambda: not liveness.is_alive(pid), "the orphaned supervisor to end",
                 timeout_s=30, every_s=0.01)
        assert not pathlib.Path(f"/dev/shm/shmbatch-{name}").exists()
    finally:
        if liveness.is_alive(pid):  # it serves on: what it started goes with it
            orphan = psutil.Process(pid)
            for p in [orphan, *orphan.children(recursive=True)]:
                p.kill()
            psutil.wait_procs([orphan], timeout=10)
        remove_if_dead(name)
