"""Backends whose batchers hold thread pools the status must report (importable by batchers)."""
import sys
import types

from helpers import affine


def with_torch(intra=2, inter=2):
    """affine, in a batcher where the model imported a module named torch:
    this stand-in, whose pools are `intra` and `inter` threads (the real one
    may not be installed; the report reads any torch the same way)."""
    torch = types.ModuleType("torch")
    torch.get_num_threads = lambda: intra
    torch.get_num_interop_threads = lambda: inter
    sys.modules["torch"] = torch
    return affine()


def counting_with_torch(intra=2, inter=2):
    """An iterative engine's step model (serve_backends.Counting) beside a torch stand-in."""
    from serve_backends import counting
    with_torch(intra, inter)
    return counting()


def doubling_model(path):
    """Writes an ONNX model to path: y = x + x, float32 [batch, 4]; returns path."""
    import onnx
    from onnx import TensorProto, helper

    from engine.tools.onnx_model import IR_VERSION, OPSET
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "doubling", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.save(model, str(path))
    return path
