"""`pip wheel .` builds one abi3 wheel, and that wheel installs and serves on a
machine with no C compiler (CC=false, no compiler on PATH).

The wheel is built from a copy of the source tree (the build writes build/ and
*.egg-info beside its sources), then installed by this interpreter's pip into a
fresh venv, without pip reaching any index: the venv finds numpy and the other
dependencies in this interpreter's site-packages through a path file (a path,
not a site: the editable install of this checkout is not seen there), so the
engine it runs is the wheel's.
"""
import os
import pathlib
import shutil
import site
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from conftest import reap, unique_name, wait_for_line

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ("setup.py", "pyproject.toml", "README.md", "engine", "csrc")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns(
                "__pycache__", "*.so", "_ringc.c", "*.o"))
        else:
            shutil.copy2(ROOT / name, src / name)
    out = work / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                    "--no-build-isolation", "--no-index", "-q", "-w", str(out)],
                   check=True, capture_output=True, timeout=600)
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_the_wheel_is_tagged_abi3_for_cpython_3_11_and_later(wheel):
    name, version, python, abi, platform = wheel.stem.split("-")
    assert (name, python, abi) == ("shmbatch", "cp311", "abi3"), wheel.name
    assert platform == sysconfig.get_platform().replace("-", "_").replace(".", "_")


def test_the_wheel_installs_and_serves_without_a_compiler(wheel, tmp_path):
    venv = tmp_path / "venv"
    # no pip of its own (seconds of ensurepip): this interpreter's pip installs into it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=300)
    bin_dir = venv / "bin"
    purelib = subprocess.run([str(bin_dir / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (pathlib.Path(purelib) / "dependencies.pth").write_text(
        "\n".join(site.getsitepackages()) + "\n")
    env = {"PATH": str(bin_dir), "CC": "false", "CXX": "false", "HOME": str(tmp_path),
           "LANG": "C.UTF-8"}
    assert shutil.which("gcc", path=env["PATH"]) is None
    subprocess.run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install",
                    "--no-deps", "--no-index", "-q", str(wheel)], check=True, env=env,
                   cwd=tmp_path, timeout=300)
    name = unique_name("wheel")
    serve = subprocess.Popen([str(bin_dir / "shmbatch"), "serve", "--name", name, "--backend",
                              "engine.backends:identity", "--input-shape", "4",
                              "--output-shape", "4"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, env=env, cwd=tmp_path)
    try:
        wait_for_line(serve.stdout, "ready", timeout_s=120)
        client = textwrap.dedent(f"""
            import numpy as np, engine
            with engine.Client({name!r}) as c:
                for k in range(8):
                    x = np.arange(4, dtype=np.float32) + k
                    assert np.array_equal(c.infer(x, timeout=30), x)
            print(engine.__file__)
        """)
        done = subprocess.run([str(bin_dir / "python"), "-c", client], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().startswith(purelib), done.stdout  # the wheel's engine
    finally:
        assert reap(serve) == 0
    assert not any(name in p for p in os.listdir("/dev/shm"))
