"""The onnx backend and the encoder the benchmark serves with it (no engine started)."""
import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from engine import backends  # noqa: E402
from engine.tools.onnx_model import build_encoder, encoder_tensors  # noqa: E402


@pytest.fixture(scope="module")
def encoder_path(tmp_path_factory):
    return build_encoder(tmp_path_factory.mktemp("onnx") / "encoder.onnx")


def padded_batch(requests):
    """Rows of token ids -> the engine's batch: zero-padded to the longest, with a mask."""
    width = max(len(r) for r in requests)
    ids = np.zeros((len(requests), width), np.int64)
    for row, r in zip(ids, requests):
        row[:len(r)] = r
    mask = (np.arange(width) < np.array([len(r) for r in requests])[:, None]).astype(np.int64)
    return {"input_ids": ids, "attention_mask": mask}, {"input_ids": mask.sum(1), "attention_mask": mask.sum(1)}


def test_a_padded_batch_answers_each_request_as_if_it_ran_alone_unpadded(encoder_path):
    fn = backends.onnx(encoder_path)
    rng = np.random.default_rng(7)
    requests = [rng.integers(1, 1000, n) for n in (3, 17, 1, 40, 9)]
    batch, lengths = padded_batch(requests)
    out = fn(batch, lengths)
    assert set(out) == {"embedding", "logits"}
    assert out["embedding"].shape == (5, 64) and out["logits"].shape == (5, 10)
    for i, r in enumerate(requests):
        alone = fn({"input_ids": r[None], "attention_mask": np.ones((1, len(r)), np.int64)})
        for name in ("embedding", "logits"):
            np.testing.assert_allclose(out[name][i], alone[name][0], rtol=1e-4, atol=1e-5)


def test_check_tensors_accepts_the_encoders_own_description(encoder_path):
    assert backends.onnx(encoder_path).check_tensors(*encoder_tensors()) is None


def test_check_tensors_names_a_wrong_input_name(encoder_path):
    inputs, outputs = encoder_tensors()
    inputs["token_ids"] = inputs.pop("input_ids")
    with pytest.raises(ValueError) as e:
        backends.onnx(encoder_path).check_tensors(inputs, outputs)
    assert "'token_ids'" in str(e.value) and "'input_ids'" in str(e.value)


def test_check_tensors_names_a_wrong_dtype(encoder_path):
    inputs, outputs = encoder_tensors()
    inputs["input_ids"] = ("int32", (None,))
    with pytest.raises(ValueError, match=r"'input_ids' dtype is int32, model has int64"):
        backends.onnx(encoder_path).check_tensors(inputs, outputs)


def test_check_tensors_names_a_missing_output(encoder_path):
    inputs, outputs = encoder_tensors()
    del outputs["embedding"]
    with pytest.raises(ValueError, match=r"output 'embedding'"):
        backends.onnx(encoder_path).check_tensors(inputs, outputs)


def test_check_tensors_names_a_fixed_dim_that_differs(encoder_path):
    inputs, outputs = encoder_tensors()
    outputs["logits"] = ("float32", (12,))
    with pytest.raises(ValueError, match=r"'logits' dim 1 is 12, model fixes it to 10"):
        backends.onnx(encoder_path).check_tensors(inputs, outputs)


def test_a_one_input_one_output_model_serves_a_plain_array_batch(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "matmul.onnx"))

    fn = backends.onnx(tmp_path / "matmul.onnx", intra_op_threads=1)
    x = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    np.testing.assert_allclose(fn(x), x @ w, rtol=1e-5, atol=1e-6)
    assert fn.check_tensors({"x": ("float32", (4,))}, {"y": ("float32", (3,))}) is None


def test_an_engine_serving_the_model_answers_each_process_as_the_model_alone(encoder_path,
                                                                           make_engine, fork_ctx):
    import engine
    inputs, outputs = encoder_tensors()
    eng = make_engine("onnx", backend="engine.backends:onnx",
                      backend_args={"path": str(encoder_path), "intra_op_threads": 1},
                      inputs=inputs, outputs=outputs, max_batch_size=8,
                      max_input_shapes={"input_ids": (48,), "attention_mask": (48,)},
                      length_buckets=[16, 48])

    def request(k):
        ids = np.random.default_rng(k).integers(1, 1000, 1 + k % 48)
        return {"input_ids": ids, "attention_mask": np.ones(len(ids), np.int64)}

    def sender(first, q):
        with engine.Client(eng.name) as c:
            futures = [(k, c.submit(request(k), timeout=60)) for k in range(first, first + 16)]
            q.put([(k, f.result(timeout=60)) for k, f in futures])

    q = fork_ctx.Queue()
    procs = [fork_ctx.Process(target=sender, args=(100 * p, q)) for p in range(3)]
    for p in procs:
        p.start()
    answers = [a for _ in procs for a in q.get(timeout=120)]
    for p in procs:
        p.join(10)
    alone = backends.onnx(encoder_path)
    assert len(answers) == 48
    for k, y in answers:
        x = request(k)
        want = alone({name: a[None] for name, a in x.items()})
        for name in ("embedding", "logits"):
            np.testing.assert_allclose(y[name], want[name][0], rtol=1e-4, atol=1e-5)


def test_an_engine_whose_tensors_do_not_fit_the_model_does_not_start(encoder_path, make_engine):
    import engine
    inputs, outputs = encoder_tensors()
    inputs = {"token_ids" if name == "input_ids" else name: spec for name, spec in inputs.items()}
    with pytest.raises(engine.BackendError, match="'token_ids' is not a model input"):
        make_engine("onnx-bad", backend="engine.backends:onnx",
                    backend_args={"path": str(encoder_path)}, inputs=inputs, outputs=outputs,
                    max_input_shapes={"token_ids": (48,), "attention_mask": (48,)})


def test_the_model_bench_answers_right_with_and_without_buckets():
    from engine.tools import model_bench
    rows = model_bench.run(model_bench.Setup(batch_sizes=(4,), clients=2, in_flight=4,
                                             seconds=0.5), log=lambda line: None)
    buckets = list(model_bench.BUCKETS)
    assert [r["length_buckets"] for r in rows] == [[], buckets, buckets]
    assert [r["allowed_batch_sizes"] for r in rows] == [[], [], [1, 2, 4]]
    for r in rows:
        assert (r["errors"], r["wrong"]) == (0, 0) and r["checked"] > 0 and r["answered"] > 0
        assert r["padding_waste"] >= 1.0
