"""One launcher starts every child process (batchers, HTTP workers): it hands
the child its arguments, waits for its one readiness message, and reports a
failure by its kind and message."""
import os
import subprocess
import sys

import pytest

from engine import launch

CHILD = "launch_child"


def start(**args):
    return launch.launch(CHILD, args)


def test_a_ready_child_is_reported_ready_and_keeps_running():
    proc, reader = start(do="ready")
    try:
        launch.await_ready(proc, reader, 30, "child", died="ChildDied")
        assert proc.is_alive()
        assert proc.ready_info == {"parent_pid": os.getpid()}  # whoever reaps it later
    finally:
        reader.close()
        launch.kill(proc)
    assert proc.exitcode is not None


def failure(timeout_s=30, what="child", **args) -> launch.ChildFailed:
    """How a child that does not become ready is reported."""
    proc, reader = start(**args)
    try:
        with pytest.raises(launch.ChildFailed) as info:
            launch.await_ready(proc, reader, timeout_s, what, died="ChildDied")
    finally:
        reader.close()
        launch.kill(proc)
    return info.value


def test_a_child_that_raises_reports_its_error_type_and_message():
    e = failure(do="raise", path="/models/x")
    assert (e.kind, e.message) == ("LookupError", "no model at /models/x")
    assert "LookupError" in e.trace


def test_a_child_that_exits_during_start_is_named_with_its_exit_code():
    e = failure(do="exit", what="child 7")
    assert (e.kind, e.message) == ("ChildDied", "child 7 exited during start (exit code 3)")


def test_a_child_not_ready_in_time_is_a_start_timeout():
    assert failure(do="hang", timeout_s=0.2).kind == "StartTimeout"


def test_arguments_that_cannot_be_pickled_fail_before_any_process_starts():
    with pytest.raises(launch.ChildFailed) as info:
        start(do="ready", fn=lambda: None)
    assert "pickle" in info.value.message.lower() or "lambda" in info.value.message


def gone_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60)
    return int(done.stdout)


@pytest.mark.parametrize("spawner", ["parent", "gone", "alive, not the parent"])
def test_a_child_dies_at_once_only_if_its_spawner_is_gone_whoever_adopted_it(spawner):
    # an orphan is adopted by init or by a subreaper (a container's init): the check is
    # against the spawner's pid passed down, not pid 1; a wrapper between a live spawner
    # and the child (valgrind, a launcher script) is no orphaning
    pid = {"parent": "os.getppid()", "gone": str(gone_pid()),
           "alive, not the parent": str(os.getppid())}[spawner]  # this test's own parent
    code = (f"import os; from engine.shm import liveness; "
            f"liveness.die_with_parent({pid}); print('alive')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout.strip()) == \
        ((1, "") if spawner == "gone" else (0, "alive"))
