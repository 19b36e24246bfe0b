"""What the manifest tests share: a serve config on disk, `shmbatch manifest`
run in this process and in its own, its YAML read back, and the schemas the
objects must pass (Kubernetes' own, offline, and the CRDs' vendored ones)."""
import contextlib
import io
import json
import pathlib
import subprocess
import sys

import pytest

from engine.cli import commands

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = pathlib.Path(__file__).parent / "schemas"
MIB = 1 << 20
KUBERNETES_VERSIONS = ("1.30.0", "latest")


def write_config(path: pathlib.Path, engines: dict, **serve) -> pathlib.Path:
    """A serve config of [engines.NAME] tables (each a dict of TOML values as text)."""
    lines = [f"{k} = {v}" for k, v in serve.items()]
    for name, keys in engines.items():
        lines += ["", f"[engines.{name}]"] + [f"{k} = {v}" for k, v in keys.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def run(*argv):
    """`shmbatch manifest ...` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = commands.main(["manifest", *map(str, argv)])
        except SystemExit as e:  # argparse's refusals
            code = e.code
    return code, out.getvalue(), err.getvalue()


def run_process(*argv) -> subprocess.CompletedProcess:
    """`python -m engine manifest ...` as its own process."""
    return subprocess.run([sys.executable, "-m", "engine", "manifest", *map(str, argv)],
                          capture_output=True, text=True, timeout=120,
                          cwd=pathlib.Path(__file__).parent.parent)


def manifest(*argv) -> list:
    """The documents of a manifest that must be made."""
    code, out, err = run(*argv)
    assert code == 0 and err == "", err
    return list(yaml.safe_load_all(out))


def by_kind(docs: list) -> dict:
    kinds = [d["kind"] for d in docs]
    assert len(kinds) == len(set(kinds)), kinds
    return {d["kind"]: d for d in docs}


def quantity_bytes(text: str) -> int:
    """A Kubernetes binary quantity (the manifests write Mi)."""
    assert text.endswith("Mi"), text
    return int(text[:-2]) * MIB


def k8s_validate(doc: dict, version: str) -> None:
    """Kubernetes' own schema of the object's kind, strict (an unknown field fails)."""
    kv = pytest.importorskip("kubernetes_validate")
    kv.validate(doc, kv.latest_version() if version == "latest" else version, strict=True)


def strict(schema):
    """A CRD schema as the API server applies it: a field the schema does not
    name is pruned there (silently lost), so it fails here."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_validate(doc: dict, file: str) -> None:
    vendored = json.loads((SCHEMAS / file).read_text())
    jsonschema.validate(doc, strict(vendored["openAPIV3Schema"]))


def serve_container(doc: dict) -> dict:
    """The `shmbatch serve` container of a Deployment or a ServingRuntime."""
    spec = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc["spec"]
    found = [c for c in spec.get("initContainers", []) + spec["containers"]
             if c.get("command") == ["shmbatch"] and c["args"][0] == "serve"]
    assert len(found) == 1, spec
    return found[0]


def shm_volume(doc: dict) -> dict:
    spec = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc["spec"]
    serve = serve_container(doc)
    mounted = [m["name"] for m in serve["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert len(mounted) == 1
    return next(v for v in spec["volumes"] if v["name"] == mounted[0])
