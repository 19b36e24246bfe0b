"""The public API is typed: mypy passes on its modules, and on a user's code
that calls it, and catches a wrong call."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def mypy(*args):
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_mypy_passes_on_the_public_modules():
    out = mypy()  # the files and settings of pyproject.toml's [tool.mypy]
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_users_calls_type_check_and_a_wrong_one_is_caught(tmp_path):
    user = tmp_path / "user.py"
    user.write_text(
        "import numpy as np\nimport engine\n\n"
        "def predict(c: engine.Client) -> np.ndarray:\n"
        "    y = c.infer(np.ones(16, np.float32), timeout=1.0)\n"
        "    f = c.submit(np.ones(16, np.float32))\n"
        "    return y + f.result()\n\n"
        "def named(c: engine.Client) -> float:\n"
        "    return float(c.infer({'x': np.ones(3)})['y'].sum())\n\n"
        "def wrong(c: engine.Client) -> None:\n"
        "    c.infer(np.ones(16), timeout='soon')\n")
    out = mypy("--follow-imports=silent", str(user))
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "user.py:13" in errors[0] and "timeout" in errors[0], out.stdout
