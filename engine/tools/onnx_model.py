"""A small transformer-style ONNX encoder, for the tests and the benchmark's real-model row.

build_encoder writes a model with random weights (nothing to download) that
does the work of a real text encoder: token + position embeddings, multi-head
self-attention with a key padding mask, feed-forward, LayerNormalization, and
masked mean pooling. Padding is masked out of every attention key and out of
the pooling, so a request's outputs do not depend on how much zero padding
follows its tokens nor on which other rows share its batch: the property a
batching engine needs from a variable-length model.

encoder_tensors gives the engine's description of the same model.
"""
import numpy as np

OPSET = 17  # the first with LayerNormalization; onnxruntime has run it since 1.14
IR_VERSION = 8  # the IR of opset 17, so older onnxruntimes load the file too


def build_encoder(path, vocab=1000, d_model=64, heads=4, layers=2, max_len=128,
                  classes=10, seed=0):
    """Writes the encoder to path: inputs input_ids and attention_mask, int64
    [batch, seq] (seq <= max_len); outputs embedding float32 [batch, d_model]
    (the masked mean of the last layer) and logits float32 [batch, classes]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if d_model % heads:
        raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
    rng = np.random.default_rng(seed)
    head_dim = d_model // heads
    nodes, inits = [], []

    def const(name, value, dtype=np.float32):
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def weight(name, *shape):
        # scaled by fan-in so activations stay O(1) through the layers
        return const(name, rng.standard_normal(shape) / np.sqrt(shape[0]))

    def node(op, inputs, out, **attrs):
        nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def linear(x, name, d_in, d_out):
        return node("Add", [node("MatMul", [x, weight(f"{name}.w", d_in, d_out)], f"{name}.mm"),
                            const(f"{name}.b", np.zeros(d_out))], name)

    def layer_norm(x, name):
        return node("LayerNormalization",
                    [x, const(f"{name}.g", np.ones(d_model)), const(f"{name}.b", np.zeros(d_model))],
                    name, axis=-1, epsilon=1e-5)

    # embeddings: token + learned position 0..seq-1 (seq read from the input's shape)
    tok = node("Gather", [const("tok_emb", rng.standard_normal((vocab, d_model)) * 0.5),
                          "input_ids"], "tok")
    seq = node("Squeeze", [node("Shape", ["input_ids"], "seq_1d", start=1, end=2),
                           const("axis0", [0], np.int64)], "seq")
    pos_ids = node("Range", [const("zero", 0, np.int64), seq, const("one", 1, np.int64)], "pos_ids")
    pos = node("Gather", [const("pos_emb", rng.standard_normal((max_len, d_model)) * 0.5),
                          pos_ids], "pos")
    x = node("Add", [tok, pos], "x0")

    # mask: 1.0 for real tokens, and -1e9 added to the score of every padded key,
    # so softmax gives padding exactly zero weight
    mask = node("Cast", ["attention_mask"], "mask", to=TensorProto.FLOAT)
    key_bias = node("Reshape", [node("Mul", [node("Sub", [mask, const("f_one", 1.0)], "mask_m1"),
                                             const("big", 1e9)], "key_bias_2d"),
                                const("bias_shape", [0, 1, 1, -1], np.int64)], "key_bias")
    split_heads = const("split_heads", [0, 0, heads, head_dim], np.int64)  # 0: keep that dim
    merge_heads = const("merge_heads", [0, 0, d_model], np.int64)
    scale = const("scale", 1.0 / np.sqrt(head_dim))

    for i in range(layers):
        p = f"l{i}"

        def heads_of(name, perm):  # [B, S, D] -> [B, H, S, hd], or [B, H, hd, S] for keys
            return node("Transpose", [node("Reshape", [linear(x, f"{p}.{name}", d_model, d_model),
                                                       split_heads], f"{p}.{name}.split")],
                        f"{p}.{name}.heads", perm=perm)

        q = heads_of("q", [0, 2, 1, 3])
        k = heads_of("k", [0, 2, 3, 1])
        v = heads_of("v", [0, 2, 1, 3])
        scores = node("Add", [node("Mul", [node("MatMul", [q, k], f"{p}.qk"), scale], f"{p}.qk_s"),
                              key_bias], f"{p}.scores")
        ctx = node("MatMul", [node("Softmax", [scores], f"{p}.attn", axis=-1), v], f"{p}.ctx")
        ctx = node("Reshape", [node("Transpose", [ctx], f"{p}.ctx_t", perm=[0, 2, 1, 3]), merge_heads],
                   f"{p}.ctx_merged")
        x = layer_norm(node("Add", [x, linear(ctx, f"{p}.o", d_model, d_model)], f"{p}.res1"), f"{p}.ln1")
        ff = linear(node("Relu", [linear(x, f"{p}.ff1", d_model, 4 * d_model)], f"{p}.relu"),
                    f"{p}.ff2", 4 * d_model, d_model)
        x = layer_norm(node("Add", [x, ff], f"{p}.res2"), f"{p}.ln2")

    # masked mean over real tokens (a row of only padding divides by 1, not 0)
    summed = node("ReduceSum", [node("Mul", [x, node("Unsqueeze", [mask, const("axis2", [2], np.int64)],
                                                     "mask_3d")], "x_masked"),
                                const("axis1", [1], np.int64)], "summed", keepdims=0)
    count = node("Max", [node("ReduceSum", [mask, const("axis1b", [1], np.int64)], "count_raw",
                              keepdims=1), const("f_one_b", 1.0)], "count")
    node("Div", [summed, count], "embedding")
    node("Identity", [linear("embedding", "cls", d_model, classes)], "logits")

    def io(name, elem, *dims):
        return helper.make_tensor_value_info(name, elem, list(dims))

    graph = helper.make_graph(
        nodes, "shmbatch_encoder",
        [io("input_ids", TensorProto.INT64, "batch", "seq"),
         io("attention_mask", TensorProto.INT64, "batch", "seq")],
        [io("embedding", TensorProto.FLOAT, "batch", d_model),
         io("logits", TensorProto.FLOAT, "batch", classes)],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="shmbatch")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return str(path)


def encoder_tensors(max_len=128, d_model=64, classes=10):
    """(inputs, outputs) of build_encoder's model in the engine's form. Both inputs
    have a variable dim; the engine's maximum for it must not exceed max_len,
    the size of the model's position table."""
    return ({"input_ids": ("int64", (None,)), "attention_mask": ("int64", (None,))},
            {"logits": ("float32", (classes,)), "embedding": ("float32", (d_model,))})
