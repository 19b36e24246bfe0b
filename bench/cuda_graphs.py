"""A GPU backend that replays CUDA graphs: one per allowed batch size and length bucket.

A compiled model runs only (or runs far faster) at the shapes it was captured
at. The engine makes every batch one of them: allowed_batch_sizes pads the
batch with zero rows up to the next allowed size, length_buckets pads the
sequence to its bucket's bound, so each batch hits a captured graph.

    engine.Engine("encoder", backend="cuda_graphs:encoder",
                  backend_args={"layers": 6, "d_model": 1024},
                  inputs={"input_ids": ("int64", (None,)), "attention_mask": ("int64", (None,))},
                  max_input_shapes={"input_ids": (128,), "attention_mask": (128,)},
                  outputs={"embedding": ("float32", (1024,))},
                  allowed_batch_sizes=SIZES, length_buckets=BUCKETS, max_batch_size=32,
                  gpus=[0]).start()          # CUDA_VISIBLE_DEVICES of the batcher

Needs PyTorch with CUDA (not a dependency of shmbatch); `bench/` must be on
sys.path of the batcher (PYTHONPATH=bench). Not run on the CPU-only machine
this project is tested on.
"""
import numpy as np

SIZES = (1, 2, 4, 8, 16, 32)
BUCKETS = (32, 64, 128)


def encoder(layers: int = 6, d_model: int = 1024, heads: int = 16, vocab: int = 30522,
            sizes=SIZES, buckets=BUCKETS, seed: int = 0):
    """A bf16 transformer encoder with random weights on this batcher's GPU,
    captured as one CUDA graph per (batch size, bucket bound)."""
    import torch

    torch.manual_seed(seed)
    device = torch.device("cuda")  # the engine's gpus=[i] set CUDA_VISIBLE_DEVICES before this
    embed = torch.nn.Embedding(vocab, d_model).to(device, torch.bfloat16)
    layer = torch.nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, batch_first=True,
                                             dtype=torch.bfloat16, device=device)
    # no nested tensors: a graph needs fixed shapes all the way through
    model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()

    def forward(ids, mask):
        keep = mask.unsqueeze(-1).to(torch.bfloat16)
        h = model(embed(ids), src_key_padding_mask=mask == 0)
        return ((h * keep).sum(1) / keep.sum(1).clamp(min=1)).float()  # masked mean pooling

    graphs = {}
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        for n in sizes:
            for length in buckets:
                ids = torch.zeros((n, length), dtype=torch.long, device=device)
                mask = torch.ones((n, length), dtype=torch.long, device=device)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm up outside the graph, as capture needs
                    for _ in range(3):
                        forward(ids, mask)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = forward(ids, mask)
                graphs[n, length] = (graph, ids, mask, out)

    def run(batch, lengths=None):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        graph, ids_in, mask_in, out = graphs[ids.shape]  # a KeyError names a shape not captured
        with torch.inference_mode():
            ids_in.copy_(torch.from_numpy(np.ascontiguousarray(ids)), non_blocking=True)
            mask_in.copy_(torch.from_numpy(np.ascontiguousarray(mask)), non_blocking=True)
            graph.replay()
            return {"embedding": out.cpu().numpy()}

    return run
