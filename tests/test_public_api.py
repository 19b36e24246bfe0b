"""The public names stay what they are."""
import argparse
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
    code = ("import sys, engine, engine.cli.commands, engine.batching.batcher, engine.serving.metrics; "
            "print(sorted(m for m in sys.modules if m.startswith(('engine.tools', 'matplotlib'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_knob_is_an_engine_keyword_a_serve_flag_and_a_config_key(tmp_path):
    from engine.cli import commands
    from engine.serving.supervisor import KNOBS
    names = [k.name for k in KNOBS]
    assert len(names) == len(set(names)) and "max_batch_size" in names and "backend" in names
    flags = subprocess.run([sys.executable, "-m", "engine", "serve", "--help"], capture_output=True,
                           text=True, timeout=60).stdout
    for knob in KNOBS:
        flag = "--backend-arg" if knob.name == "backend_args" else "--" + knob.name.replace("_", "-")
        assert flag in flags and knob.metadata["doc"]
    config = tmp_path / "engine.toml"
    config.write_text("".join(f"{k} = 1\n" for k in names if k != "backend_args"))
    args = argparse.Namespace(config=str(config), backend_arg=None, **dict.fromkeys(names))
    assert set(names) - {"backend_args"} <= set(commands.serve_settings(args))  # every key read


def test_serve_takes_named_tensors_and_batch_shapes_as_flags():
    from engine.cli import commands
    parser = argparse.ArgumentParser()
    commands._serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--name", "n", "--backend", "engine.backends:identity",
                              "--inputs", '{"ids": ["int64", [null]]}',
                              "--max-input-shapes", '{"ids": [8]}',
                              "--outputs", '{"y": ["float32", [2]]}',
                              "--allowed-batch-sizes", "1,2,4", "--length-buckets", "4"])
    settings = commands.serve_settings(args)
    config = engine.Engine(**settings).config
    assert [t.name for t in config.input_specs] == ["ids"] and config.length_buckets == (4, 8)
    assert config.allowed_batch_sizes == (1, 2, 4)


def test_shapes_as_flags_take_a_scalar_and_brackets():
    from engine.cli import args
    assert args.shape("") == args.shape("()") == args.shape("[]") == ()
    assert args.shape("64") == args.shape("(64,)") == args.shape("[64]") == (64,)
    assert args.shape("none,3") == (None, 3)
