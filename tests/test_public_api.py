"""The names of contract sections 1-3 stay what they are."""
import subprocess
import sys

import engine


def test_public_names_and_error_hierarchy():
    assert {"Engine", "Client", "EngineError", "InvalidInput", "QueueFull", "RequestTimeout",
            "BackendError", "EngineUnavailable"} <= set(engine.__all__)
    for name in ("InvalidInput", "QueueFull", "RequestTimeout", "BackendError", "EngineUnavailable"):
        assert issubclass(getattr(engine, name), engine.EngineError)
    assert issubclass(engine.InvalidInput, ValueError)
    assert issubclass(engine.RequestTimeout, TimeoutError)
    for method in ("infer", "submit", "infer_async", "close", "__enter__", "__exit__"):
        assert callable(getattr(engine.Client, method))
    for method in ("start", "stop", "stats", "__enter__", "__exit__"):
        assert callable(getattr(engine.Engine, method))


def test_the_command_runs_as_a_module_and_lists_its_subcommands():
    out = subprocess.run([sys.executable, "-m", "engine", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for sub in ("serve", "status", "bench", "cleanup", "tune"):
        assert sub in out.stdout


def test_the_serving_runtime_imports_no_tooling():
    code = ("import sys, engine, engine.cli, engine.batcher, engine.metrics; "
            "print(sorted(m for m in sys.modules if m.startswith(('engine.tools', 'matplotlib'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
