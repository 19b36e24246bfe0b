"""The serve container's memory in `shmbatch manifest`: measured by a real run
of the config (--measure: serve, its batchers and HTTP workers, each one's
PSS outside /dev/shm; request = measured + margin, limit = measured x
factor), or a budget per batcher (--memory-per-batcher), or the default,
which the manifest says is a guess."""
import math
import mmap
import os
import re

import numpy as np
import psutil
import pytest
from conftest import shm_entries, unique_name
from manifest_helpers import (KUBERNETES_VERSIONS, MIB, by_kind, k8s_validate,
                              quantity_bytes, run, serve_container, shm_volume, write_config, yaml)

import engine
from engine.tools import manifest_kserve, manifest_pod

MARGIN_MIB, FACTOR = 8, 2.0


def table(**keys) -> dict:
    return {"backend": '"engine.backends:synthetic"', "input_shape": "[64]",
            "output_shape": "[64]", "max_batch_size": 4, "instances": 2, **keys}


def note(deployment_text: str) -> str:
    """The Deployment's comments, their lines joined as the note was written."""
    return " ".join(line.strip()[2:] for line in deployment_text.splitlines()
                    if line.strip().startswith("# "))


def resources(doc: dict) -> tuple:
    res = serve_container(doc)["resources"]
    return (quantity_bytes(res["requests"]["memory"]) // MIB,
            quantity_bytes(res["limits"]["memory"]) // MIB)


def serve_processes() -> list:
    """This process's descendants running `shmbatch serve`."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "serve" in child.cmdline():
                out.append(child.pid)
        except psutil.Error:
            pass
    return out


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One --measure run of an engine of two batchers behind one HTTP worker:
    (its engine's name, exit status, stdout, stderr)."""
    name = unique_name("measure")
    path = write_config(tmp_path_factory.mktemp("measure") / "models.toml", {name: table()},
                        http_port=8000, http_workers=1)
    code, out, err = run("kubernetes", "--config", path, "--image", "i", "--measure",
                         "--memory-margin-mib", MARGIN_MIB, "--memory-limit-factor", FACTOR)
    return name, code, out, err


def test_measure_sizes_the_memory_from_serve_its_batchers_and_http_worker(measured):
    name, code, out, err = measured
    assert code == 0, err
    docs = list(yaml.safe_load_all(out))
    deployment = by_kind(docs)["Deployment"]
    for version in KUBERNETES_VERSIONS:
        k8s_validate(deployment, version)
    text = note(out)
    each = re.search(r"the emptyDir's\): (.*?); (\d+) MiB in all \(their RSS, which counts a "
                     r"shared page in each process: (\d+) MiB\)", text)
    assert each, text
    figures = dict(re.fullmatch(r"(.+) (\d+) MiB", part).groups()
                   for part in each[1].split(", "))
    assert list(figures) == ["serve", f"batcher {name} 0", f"batcher {name} 1", "HTTP worker 0"]
    # every process is a Python interpreter with numpy: more than a few MiB of its own
    assert all(int(mib) >= 5 for mib in figures.values()), figures
    total, rss = int(each[2]), int(each[3])
    assert sum(map(int, figures.values())) - len(figures) <= total <= sum(map(int, figures.values()))
    assert rss >= total  # RSS counts each shared page in every process, PSS splits it
    shm = quantity_bytes(shm_volume(deployment)["emptyDir"]["sizeLimit"]) // MIB
    request, limit = resources(deployment)
    assert request == shm + total + MARGIN_MIB
    assert limit == max(request, shm + math.ceil(total * FACTOR))
    assert f"request {request} MiB = {shm} + {total} + a margin of {MARGIN_MIB}" in text
    assert f"limit {limit} MiB = {shm} + {total} x {FACTOR:g}" in text


def test_measure_leaves_no_process_and_nothing_in_dev_shm(measured):
    name, code, out, err = measured
    assert code == 0
    assert not [e for e in shm_entries() if name in e]
    assert not serve_processes()
    with pytest.raises(engine.EngineUnavailable):
        engine.Client(name)
    lines = err.splitlines()  # what it is doing while a model loads, then what it found
    assert lines[0].startswith("shmbatch manifest: measuring") and len(lines) == 2
    assert re.fullmatch(r"shmbatch manifest: measured \d+ MiB in 4 processes", lines[1])


def test_a_process_figure_leaves_dev_shm_out():
    """/dev/shm is the emptyDir's, sized from the segments: its pages, resident
    in this process, are not counted again."""
    from engine.tools import manifest_measure
    size = 32 * MIB
    path = f"/dev/shm/shmbatch-{unique_name('pss')}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        before_pss, _ = manifest_measure.process_memory(os.getpid())
        before_rss = psutil.Process().memory_info().rss
        with mmap.mmap(fd, size) as mapped:
            np.frombuffer(mapped, np.uint8)[::4096] = 1  # every page resident
            after_pss, _ = manifest_measure.process_memory(os.getpid())
            after_rss = psutil.Process().memory_info().rss
    finally:
        os.close(fd)
        os.unlink(path)
    assert after_rss - before_rss >= size  # resident in this process ...
    assert after_pss - before_pss < 8 * MIB  # ... and not counted


@pytest.fixture
def config(tmp_path):
    return write_config(tmp_path / "models.toml", {unique_name("mem"): table()},
                        http_port=8000, http_workers=1)


def test_memory_per_batcher_sizes_the_batchers_and_the_rest_stays_per_process(config):
    out = run("kubernetes", "--config", config, "--image", "i", "--memory-per-batcher", "1.5Gi",
              "--process-memory-mib", 100)[1]
    deployment = by_kind(list(yaml.safe_load_all(out)))["Deployment"]
    shm = quantity_bytes(shm_volume(deployment)["emptyDir"]["sizeLimit"]) // MIB
    assert resources(deployment) == (shm + 2 * 1536 + 2 * 100,) * 2  # serve and an HTTP worker
    assert "2 batcher(s) x 1536 (--memory-per-batcher)" in note(out)
    assert "GUESS" not in note(out)


def test_without_measure_the_manifest_says_its_default_is_a_guess_and_how_to_measure(config):
    out = run("kubernetes", "--config", config, "--image", "i")[1]
    deployment = by_kind(list(yaml.safe_load_all(out)))["Deployment"]
    shm = quantity_bytes(shm_volume(deployment)["emptyDir"]["sizeLimit"]) // MIB
    assert resources(deployment) == (shm + 4 * 256,) * 2
    text = note(out)
    assert "The 256 MiB a process is a GUESS" in text
    assert "`shmbatch manifest ... --measure`" in text and "--memory-per-batcher SIZE" in text


@pytest.mark.parametrize("flags, expected", [
    (["--memory-per-batcher", "2 GB please"], "expected a size like 2Gi"),
    (["--memory-per-batcher", "512Ki"], "expected at least 1Mi"),
    (["--measure", "--memory-per-batcher", "2Gi"], "expected one of them"),
    (["--memory-limit-factor", "2"], "expected --measure"),
    (["--measure", "--memory-limit-factor", "0.5"], "--memory-limit-factor >= 1"),
], ids=["size", "tiny", "both", "factor-alone", "factor-below-1"])
def test_memory_flags_refused_say_what_was_expected_and_start_nothing(config, flags, expected):
    code, out, err = run("kubernetes", "--config", config, "--image", "i", *flags)
    assert code == 1 and out == ""
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not serve_processes()


def test_a_model_that_fails_to_start_fails_the_measure_with_serves_reason(tmp_path):
    name = unique_name("broken")
    path = write_config(tmp_path / "models.toml", {name: table(
        backend='"no_such_module_here:load"', instances=1)}, http_port=8000)
    code, out, err = run("kubernetes", "--config", path, "--image", "i", "--measure")
    assert code == 1 and out == ""
    last = err.splitlines()[-1]
    assert last.startswith("shmbatch manifest: --measure: serve exited (1) before it was ready")
    assert "no_such_module_here" in last
    assert not [e for e in shm_entries() if name in e] and not serve_processes()


def test_kserve_sizes_its_runtime_from_a_measure():
    pod = manifest_pod.serve_pod(
        [{"name": "digits", "backend": "engine.backends:synthetic", "input_shape": (64,),
          "output_shape": (64,), "instances": 2}], {}, name=None, image="i", metrics_port=None,
        headroom_mib=64, process_mib=256, http_port=manifest_kserve.HTTP_PORT)
    pod.measured = manifest_pod.Measured(
        processes=(("serve", 40 * MIB), ("batcher digits 0", 900 * MIB),
                   ("batcher digits 1", 900 * MIB + 1), ("HTTP worker 0", 50 * MIB)),
        rss_bytes=2500 * MIB, requests=10)
    runtime = by_kind(list(yaml.safe_load_all(manifest_kserve.kserve(pod, "")))
                      )["ServingRuntime"]
    shm = pod.shm_bytes // MIB
    total = 40 + 900 + 901 + 50  # the sum, in whole MiB rounded up
    assert resources(runtime) == (shm + total + 64, shm + math.ceil(total * 1.5))
