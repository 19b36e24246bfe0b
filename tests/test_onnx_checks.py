"""An ONNX model checked against every engine's tensors before `ready`, a
subset of its outputs served, and the error that names the ZipMap fix."""
import numpy as np
import pytest

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

import engine  # noqa: E402
from engine import backends  # noqa: E402

W = np.arange(12, dtype=np.float32).reshape(4, 3)


def save(path, nodes, outputs, opsets=(("", 17),)):
    from onnx import TensorProto, helper, numpy_helper
    graph = helper.make_graph(
        nodes, "model", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        outputs, [numpy_helper.from_array(W, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


@pytest.fixture(scope="module")
def two_outputs(tmp_path_factory):
    """y = x @ W (float32[3]) and total = the sum of each row (float32[1])."""
    from onnx import TensorProto, helper
    return save(tmp_path_factory.mktemp("onnx") / "two.onnx",
                [helper.make_node("MatMul", ["x", "W"], ["y"]),
                 helper.make_node("ReduceSum", ["x"], ["total"], keepdims=1)],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
                 helper.make_tensor_value_info("total", TensorProto.FLOAT, ["batch", 1])])


@pytest.fixture(scope="module")
def zipmap(tmp_path_factory):
    """As skl2onnx exports a classifier by default: a label and a ZipMap of probabilities."""
    from onnx import TensorProto, helper
    probabilities = helper.make_sequence_type_proto(helper.make_map_type_proto(
        TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, None)))
    return save(tmp_path_factory.mktemp("onnx") / "zipmap.onnx",
                [helper.make_node("MatMul", ["x", "W"], ["scores"]),
                 helper.make_node("ArgMax", ["scores"], ["label"], axis=1, keepdims=0),
                 helper.make_node("ZipMap", ["scores"], ["probabilities"], domain="ai.onnx.ml",
                                  classlabels_int64s=[0, 1, 2])],
                [helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"]),
                 helper.make_value_info("probabilities", probabilities)],
                opsets=(("", 17), ("ai.onnx.ml", 3)))


def test_a_single_array_engine_on_a_two_output_model_fails_at_start_naming_both(two_outputs,
                                                                                make_engine):
    with pytest.raises(engine.BackendError, match=r"one input and one output.*\['y', 'total'\]"):
        make_engine("two", backend="engine.backends:onnx", backend_args={"path": two_outputs},
                    input_shape=(4,), output_shape=(1,))


def test_a_single_array_engine_whose_output_differs_from_the_model_fails_at_start(two_outputs,
                                                                                 make_engine):
    with pytest.raises(engine.BackendError, match=r"output 'y' dim 1 is 1, model fixes it to 3"):
        make_engine("dims", backend="engine.backends:onnx",
                    backend_args={"path": two_outputs, "outputs": ["y"]},
                    input_shape=(4,), output_shape=(1,))


def test_one_output_of_two_serves_a_single_array_engine(two_outputs, make_engine):
    eng = make_engine("subset", backend="engine.backends:onnx",
                      backend_args={"path": two_outputs, "outputs": ["total"]},
                      input_shape=(4,), output_shape=(1,))
    x = np.arange(4, dtype=np.float32)
    with engine.Client(eng.name) as c:
        np.testing.assert_allclose(c.infer(x, timeout=10), [x.sum()])


def test_a_named_engine_may_serve_a_subset_of_the_outputs(two_outputs, make_engine):
    eng = make_engine("named-subset", backend="engine.backends:onnx",
                      backend_args={"path": two_outputs, "outputs": ["y"]},
                      inputs={"x": ("float32", (4,))}, outputs={"y": ("float32", (3,))})
    x = np.arange(4, dtype=np.float32)
    with engine.Client(eng.name) as c:
        y = c.infer({"x": x}, timeout=10)
    assert list(y) == ["y"]
    np.testing.assert_allclose(y["y"], x @ W, rtol=1e-6)


def test_outputs_that_the_model_does_not_have_are_refused(two_outputs):
    with pytest.raises(ValueError, match=r"outputs=\['logits'\].*\['y', 'total'\]"):
        backends.onnx(two_outputs, outputs=["logits"])


def test_a_zipmap_output_is_refused_with_the_export_option_that_fixes_it(zipmap):
    fn = backends.onnx(zipmap)
    with pytest.raises(ValueError, match=r"'probabilities' is seq\(map.*'zipmap': False"):
        fn.check_tensors({"x": ("float32", (4,))}, {"label": ("int64", ()),
                                                    "probabilities": ("float32", (3,))})


def test_the_label_beside_a_zipmap_serves_as_a_scalar_per_request(zipmap, make_engine):
    eng = make_engine("label", backend="engine.backends:onnx",
                      backend_args={"path": zipmap, "outputs": ["label"]},
                      input_shape=(4,), output_shape=(), output_dtype="int64")
    x = np.array([1, 0, 0, 0], np.float32)
    with engine.Client(eng.name) as c:
        assert int(c.infer(x, timeout=10)) == int(np.argmax(x @ W))
