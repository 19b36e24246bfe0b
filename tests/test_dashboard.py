"""`shmbatch dashboard`: a Grafana dashboard whose every query names a family
that a running engine's /metrics really exports, and that shows every family
it exports."""
import json
import re
import urllib.request

import numpy as np
import pytest
from conftest import unique_name
from test_sidecar import free_port, shmbatch

import engine

X = np.arange(16, dtype=np.float32)
SUFFIXES = ("_bucket", "_sum", "_count")


def family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


@pytest.fixture(scope="module")
def board() -> dict:
    out = shmbatch("dashboard")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def scraped(serves_module) -> dict:
    """{sample family: {label: values}} of a live engine's /metrics, after a
    few requests."""
    port = free_port()
    s = serves_module(unique_name("board"), "--metrics-port", str(port))
    with engine.Client(s.name) as c:
        for k in range(5):
            assert np.array_equal(c.infer(X + k, timeout=10), (X + k) * 2 + 1)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("shmbatch_"):
            name, _, rest = line.partition("{")
            labels = found.setdefault(family(name.split(" ")[0]), {})
            for key, value in re.findall(r'(\w+)="([^"]*)"', rest.partition("}")[0]):
                labels.setdefault(key, set()).add(value)
    assert found["shmbatch_requests_total"]["engine"] == {s.name}
    return found


@pytest.fixture(scope="module")
def serves_module():
    from test_sidecar import Serve
    started = []

    def start(*args, **kwargs):
        started.append(Serve(*args, **kwargs))
        return started[-1]
    yield start
    for s in started:
        assert s.stop() == 0


def exprs(board: dict) -> list:
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def test_the_dashboard_is_grafana_json_with_unique_ids_and_places(board):
    assert board["schemaVersion"] >= 39 and board["uid"] and board["title"]
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0 and g["y"] >= 0
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
    shown = [p for p in panels if p["type"] != "row"]
    assert shown and all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in shown)


def test_queries_read_the_chosen_datasource_and_engines(board):
    variables = {v["name"]: v for v in board["templating"]["list"]}
    source = [v for v in variables.values() if v["type"] == "datasource"]
    assert len(source) == 1 and source[0]["query"] == "prometheus"
    uid = "${%s}" % source[0]["name"]
    assert variables["engine"]["query"]["query"] == "label_values(shmbatch_requests_total, engine)"
    assert variables["engine"]["datasource"]["uid"] == uid
    shown = [p for p in board["panels"] if p["type"] != "row"]
    assert all(p["datasource"]["uid"] == uid and
               all(t["datasource"]["uid"] == uid for t in p["targets"]) for p in shown)
    for expr in exprs(board):  # each metric selector is narrowed to the chosen engines
        for selector in re.findall(r"shmbatch_\w+(\{[^}]*\}|)", expr):
            assert 'engine=~"$engine"' in selector, expr


def test_every_query_names_a_family_and_label_value_that_metrics_exports(board, scraped):
    for expr in exprs(board):
        for name in re.findall(r"\bshmbatch_\w+", expr):
            assert family(name) in scraped, f"{name} (in {expr}) is not on /metrics"
        for metric, selector in re.findall(r"(shmbatch_\w+)\{([^}]*)\}", expr):
            for key, value in re.findall(r'(\w+)="([^"$]*)"', selector):  # fixed values only
                assert value in scraped[family(metric)].get(key, ()), f"{key}={value} in {expr}"


def test_every_family_metrics_exports_has_a_panel(board, scraped):
    named = {family(n) for expr in exprs(board) for n in re.findall(r"\bshmbatch_\w+", expr)}
    assert not set(scraped) - named, f"not on the dashboard: {sorted(set(scraped) - named)}"
