"""A serve killed outright (an OOM kill, a liveness kill, a crash) starts again
on the /dev/shm its crash left: on a tmpfs of exactly the size `shmbatch
manifest` gives it, the dead engine's segment is removed before the restart
checks that its own fits.

The serve runs in a private mount namespace with that tmpfs over /dev/shm,
so the host's /dev/shm is never at risk; skipped where such a namespace
cannot be made (not root)."""
import json
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
from test_shm_sizing import ENV, _namespaces_work

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not _namespaces_work(),
                                reason="needs `unshare -m` and mount (root) for a private /dev/shm")

# one engine whose segment (96 MiB: 24 slots of 4 MiB, answers in place) is
# larger than the manifest's default headroom: the space a dead copy holds is
# more than the restart finds free
CONFIG = """
[engines.crashy]
backend = "engine.backends:identity"
input_shape = [1048576]
output_shape = [1048576]
queue_capacity = 24
max_batch_size = 4
"""

# In the namespace: serve, SIGKILL it once it is ready, serve again.
SCRIPT = """
import json, os, signal, subprocess, sys
import psutil

def serve():
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--config", CONFIG],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # the ready line, or EOF when the start fails
    return proc, line

def entries():
    return sorted(os.listdir("/dev/shm"))

first, first_line = serve()
family = [psutil.Process(first.pid)] + psutil.Process(first.pid).children(recursive=True)
first.send_signal(signal.SIGKILL)
first.wait(60)
gone, alive = psutil.wait_procs(family, timeout=60)
left_by_crash = entries()
second, second_line = serve()
if second_line:
    second.send_signal(signal.SIGTERM)
out, err = second.communicate(timeout=120)
print("RESULT " + json.dumps({
    "first_ready": first_line, "left_by_crash": left_by_crash, "alive_after_kill": len(alive),
    "second_ready": second_line, "second_rc": second.returncode, "second_stderr": err[-2000:],
    "shm_entries": entries(),
    "children": [p.pid for p in psutil.Process().children(recursive=True)]}))
"""


def manifest_shm_size(config: pathlib.Path) -> str:
    """The sizeLimit `shmbatch manifest kubernetes` gives the pod's /dev/shm."""
    proc = subprocess.run([sys.executable, "-m", "engine", "manifest", "kubernetes", "--config",
                           str(config), "--image", "reg/shmbatch:1", "--app-image", "reg/app:1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stderr
    return re.search(r"sizeLimit: \"?(\d+)Mi", proc.stdout).group(1) + "m"


def test_serve_killed_outright_starts_again_on_a_dev_shm_of_the_manifests_size(tmp_path):
    config = tmp_path / "models.toml"
    config.write_text(CONFIG)
    size = manifest_shm_size(config)
    body = f"CONFIG = {str(config)!r}\n" + textwrap.dedent(SCRIPT)
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f'mount -t tmpfs -o size={size},mode=1777 tmpfs /dev/shm && exec "$0" -c "$1"',
         sys.executable, body], env=ENV, capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no result (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    got = json.loads(lines[0][len("RESULT "):])
    assert "ready" in got["first_ready"]
    assert got["left_by_crash"] == ["shmbatch-crashy"] and got["alive_after_kill"] == 0
    assert "ready" in got["second_ready"], got["second_stderr"]
    assert got["second_rc"] == 0
    assert got["shm_entries"] == [] and got["children"] == []
