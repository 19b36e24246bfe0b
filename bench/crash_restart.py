"""SIGKILL `shmbatch serve` N times on a /dev/shm of exactly the manifest's size,
and start it again after each kill: every start must come up, and nothing is
left in /dev/shm nor as a process after the last stop.

    python bench/crash_restart.py [--kills 20] [--tree DIR]

Needs root (a private mount namespace with its own tmpfs over /dev/shm, so
the host's is never touched). The serve runs from --tree (default: this
file's tree), in that folder: `python -m` puts the working directory first on
the path.
"""
import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap

CONFIG = """
[engines.crashy]
backend = "engine.backends:identity"
input_shape = [1048576]
output_shape = [1048576]
queue_capacity = 24
max_batch_size = 4
"""

LOOP = """
import json, os, signal, subprocess, sys, time
import psutil

def serve():
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--config", CONFIG],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "ready" not in line:
        proc.wait(60)
        raise SystemExit(f"start failed: {proc.stderr.read()[-1000:]}")
    return proc, time.monotonic() - t0

CHECK = '''
import numpy as np, engine
with engine.Client("crashy") as c:
    x = np.arange(1 << 20, dtype=np.float32)
    raise SystemExit(0 if np.array_equal(c.infer(x, timeout=30), x) else 1)
'''

def served():  # an app's process: its mapping of the segment ends with it
    return subprocess.run([sys.executable, "-c", CHECK], timeout=120).returncode == 0

starts, right, left_after_kill = [], 0, []
proc, took = serve()
starts.append(took)
for _ in range(KILLS):
    right += served()
    family = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    psutil.wait_procs(family, timeout=60)
    left_after_kill.append(len(os.listdir("/dev/shm")))
    proc, took = serve()
    starts.append(took)
right += served()
proc.send_signal(signal.SIGTERM)
proc.communicate(timeout=120)
st = os.statvfs("/dev/shm")
print("RESULT " + json.dumps({
    "kills": KILLS, "starts": len(starts), "answers_right": right,
    "start_s_min": min(starts), "start_s_max": max(starts),
    "segments_left_after_each_kill": sorted(set(left_after_kill)),
    "shm_bytes": st.f_blocks * st.f_frsize,
    "shm_entries_after": sorted(os.listdir("/dev/shm")),
    "children_after": [p.pid for p in psutil.Process().children(recursive=True)]}))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--tree", default=str(pathlib.Path(__file__).resolve().parent.parent))
    args = p.parse_args()
    tree = pathlib.Path(args.tree).resolve()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as tmp:
        config = pathlib.Path(tmp) / "models.toml"
        config.write_text(CONFIG)
        out = subprocess.run([sys.executable, "-m", "engine", "manifest", "kubernetes", "--config",
                              str(config), "--image", "i", "--app-image", "a"], cwd=tree, env=env,
                             capture_output=True, text=True, timeout=120, check=True).stdout
        size = re.search(r'sizeLimit: "?(\d+)Mi', out).group(1)
        body = f"CONFIG = {str(config)!r}\nKILLS = {args.kills}\n" + textwrap.dedent(LOOP)
        proc = subprocess.run(
            ["unshare", "-m", "sh", "-c",
             f'mount -t tmpfs -o size={size}m,mode=1777 tmpfs /dev/shm && exec "$0" -c "$1"',
             sys.executable, body], cwd=tree, env=env, capture_output=True, text=True,
            timeout=60 * (args.kills + 2))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            got = json.loads(line[len("RESULT "):])
            print(f"tree {tree}: /dev/shm a tmpfs of the manifest's sizeLimit {size}Mi")
            print(json.dumps(got, indent=2))
            ok = (got["starts"] == args.kills + 1 and got["answers_right"] == args.kills + 1
                  and not got["shm_entries_after"] and not got["children_after"])
            return 0 if ok else 1
    print(f"no result (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
