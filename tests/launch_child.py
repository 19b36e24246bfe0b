"""A child for tests/test_launch.py: does what its arguments say."""
import os
import time

from engine import launch


def _entry() -> None:
    args, conn = launch.child_args()
    what = args["do"]
    if what == "ready":
        launch.tell_ready(conn, {"parent_pid": launch.parent_pid()})
        conn.close()
        os.read(0, 1)  # until the parent closes our stdin or kills us
    elif what == "raise":
        try:
            raise LookupError(f"no model at {args['path']}")
        except LookupError as e:
            launch.tell_failed(conn, e)
    elif what == "exit":
        os._exit(3)
    elif what == "hang":
        time.sleep(60)
