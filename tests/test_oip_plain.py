"""The Open Inference Protocol's common infer body (one input, its data in the JSON, no
parameters, no outputs asked) is read by a shorter path (engine.http.oip.request._plain):
every body here, taken or declined by it, reads exactly as the general path reads it:
the same arrays, outputs, timeout, priority and id, or the same refusal."""
import itertools
import json

import numpy as np
import pytest

from engine.http.errors import BadRequest
from engine.http.oip import request
from engine.http.oip.request import Input, Spec

SPECS = [Spec("fixed", (Input("INPUT", "FP32", (4,), (4,), 4),), ("OUTPUT",), 8, 1),
         Spec("ragged", (Input("INPUT", "INT64", (None,), (5,), 8),), ("OUTPUT",), 8, 3),
         Spec("scalar", (Input("INPUT", "INT32", (), (), 4),), ("OUTPUT", "SECOND"), 8, 1),
         Spec("two", (Input("A", "FP32", (2,), (2,), 4), Input("B", "FP32", (2,), (2,), 4)),
              ("OUTPUT",), 8, 1)]
NAMES = ["INPUT", "A", "OTHER", 3]
DATATYPES = ["FP32", "INT64", "INT32", "BYTES", None]
SHAPES = [[1, 4], [2, 4], [9, 4], [0, 4], [1, -1], [True, 4], [1, 4.0], [1], [3], [], "4"]
DATA = [[0.5, 1.0, 1.5, 2.0], [1, 2, 3, 4], [[1, 2, 3, 4]], [1, 2, 3], [1] * 8, 5,
        [1e40] * 4, [True] * 4, "x"]
EXTRA = [{}, {"id": "r1"}, {"id": 5}, {"parameters": {"timeout": 5}},
         {"outputs": [{"name": "OUTPUT"}]}]


def read(body: bytes, spec: Spec):
    try:
        p = request.parse_infer(body, None, spec, 30.0)
    except BadRequest as e:
        return "refused", e.status, str(e)
    return ("read", p.k, [(a.dtype.str, a.shape, a.tolist()) for a in p.arrays], p.wanted,
            p.timeout_s, p.priority, p.request_id, p.regions)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # 1e40 cast to float32, in both paths
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_plain_path_reads_as_the_general_one(spec, monkeypatch):
    bodies = [json.dumps({"inputs": [{"name": n, "datatype": t, "shape": s, "data": d}],
                          **e}).encode()
              for n, t, s, d, e in itertools.product(NAMES, DATATYPES, SHAPES, DATA, EXTRA)]
    bodies.append(json.dumps({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 4],
                                          "data": [1, 2, 3, 4], "parameters": {}}]}).encode())
    plain = [read(b, spec) for b in bodies]
    if spec.name == "fixed":  # the common body takes the plain path, not the general one
        assert request._plain(json.loads(bodies[0]), memoryview(b""), spec, 30.0) is not None
    monkeypatch.setattr(request, "_plain", lambda *args: None)
    general = [read(b, spec) for b in bodies]
    assert plain == general
    if spec.name == "fixed":  # and the common body is read, its data as its datatype's
        assert np.array_equal(plain[0][2][0][2], [[0.5, 1.0, 1.5, 2.0]])
