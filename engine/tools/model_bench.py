"""`shmbatch bench --model onnx`: a real model through ONNX Runtime on the CPU.

The model is a small transformer encoder with random weights, built at run
time (engine.tools.onnx_model: embedding, 2 attention blocks, masked mean
pooling; sequences up to 128 tokens). Requests draw their lengths from one
fixed, seeded distribution (mostly short, a few long, as text is). Each row
serves them at one max_batch_size, without and with length_buckets (and
with allowed_batch_sizes, powers of two, beside the buckets), to
client processes that keep a fixed number of requests in flight (a closed
loop: the figure is the most the engine serves, and the latency that comes
with it). The engine's token counters give the padding waste: padded tokens
the model computed per real token. A sample of every row's answers is
checked against the model run on each request alone.
"""
import dataclasses
import os
import tempfile
from typing import List, Optional

import numpy as np

from engine.client.client import Client
from engine.shm import ring
from engine.tools import procs
from engine.tools.load import percentiles_ms

MAX_LEN = 128
BUCKETS = (32, 64, 128)
CHECKED = 4  # answers per client checked against the model alone


@dataclasses.dataclass
class Setup:
    batch_sizes: tuple = (1, 4, 16, 32)
    clients: int = 4
    in_flight: int = 8  # per client
    seconds: float = 3.0
    seed: int = 1
    threads: int = 1  # onnxruntime intra-op threads per batcher


def lengths(n: int, seed: int) -> np.ndarray:
    """n request lengths in 1..MAX_LEN: 70 % short (4-32), 25 % medium (33-80),
    5 % long (81-128)."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, size=n, p=(0.70, 0.25, 0.05))
    low, high = np.array([4, 33, 81])[kind], np.array([32, 80, MAX_LEN])[kind]
    return rng.integers(low, high + 1)


def request(length: int, rng) -> dict:
    ids = rng.integers(1, 1000, length)
    return {"input_ids": ids, "attention_mask": np.ones(length, np.int64)}


def _client(cid, setup: Setup, conn) -> None:
    """Keeps setup.in_flight requests in flight for setup.seconds; reports the
    round trips, errors, and its first CHECKED (request, answer) pairs."""
    name = procs.await_target(conn)
    if name is None:
        return
    rng = np.random.default_rng(setup.seed * 100 + cid)
    sizes = lengths(100_000, setup.seed * 100 + cid)
    start_ns = procs.ready_for_start(conn)
    if start_ns is None:
        return
    procs.sleep_until(start_ns)
    end_ns = start_ns + int(setup.seconds * 1e9)
    round_trips, errors, checked, inflight, k = [], 0, [], [], 0
    with Client(name) as client:
        while ring.now_ns() < end_ns or inflight:
            while ring.now_ns() < end_ns and len(inflight) < setup.in_flight:
                x = request(int(sizes[k % len(sizes)]), rng)
                inflight.append((x, ring.now_ns(), client.submit(x, timeout=60)))
                k += 1
            x, sent_ns, f = inflight.pop(0)
            try:
                y = f.result(timeout=60)
                round_trips.append(ring.now_ns() - sent_ns)
                if len(checked) < CHECKED:
                    checked.append((x, y))
            except Exception:
                errors += 1
    conn.send((np.array(round_trips, np.int64), errors, checked,
               (ring.now_ns() - start_ns) / 1e9))
    conn.close()


def run_row(model_path: str, max_batch_size: int, buckets: Optional[tuple], setup: Setup,
            reference, allowed: Optional[tuple] = None) -> dict:
    from engine.tools.onnx_model import encoder_tensors
    inputs, outputs = encoder_tensors()
    name = f"bench-model-{os.getpid()}-{max_batch_size}-{'b' if buckets else 'n'}"
    batcher_cpus, client_cpus = procs.placement(1, True)
    children, conns = procs.fork_clients(_client, lambda cid, conn: (cid, setup, conn),
                                         setup.clients)
    eng = None
    try:
        from engine.serving.supervisor import Engine
        eng = Engine(name, backend="engine.backends:onnx",
                     backend_args={"path": model_path, "intra_op_threads": setup.threads},
                     inputs=inputs, outputs=outputs,
                     max_input_shapes={"input_ids": (MAX_LEN,), "attention_mask": (MAX_LEN,)},
                     max_batch_size=max_batch_size, length_buckets=buckets,
                     allowed_batch_sizes=allowed,
                     queue_capacity=max(64, setup.clients * setup.in_flight),
                     cpus=batcher_cpus).start()
        procs.go(conns, name, client_cpus, 100_000_000)
        results = procs.collect(conns, children, setup.seconds + 180)
        stats = eng.stats()
    finally:
        procs.shut(children, eng, None)
    rtt = np.concatenate([r[0] for r in results])
    wrong = 0
    for _, _, checked, _ in results:
        for x, y in checked:
            want = reference({n: a[None] for n, a in x.items()})
            wrong += any(not np.allclose(y[n], want[n][0], rtol=1e-4, atol=1e-5) for n in want)
    p = percentiles_ms(rtt)
    return {"max_batch_size": max_batch_size, "length_buckets": list(buckets or []),
            "allowed_batch_sizes": list(allowed or []),
            "rps": len(rtt) / max(r[3] for r in results), "answered": int(len(rtt)),
            "errors": sum(r[1] for r in results), "wrong": wrong,
            "checked": sum(len(r[2]) for r in results),
            "p50_ms": p["p50"], "p99_ms": p["p99"], "avg_batch": stats["avg_batch_size"],
            "padding_waste": stats["padded_tokens_total"] / max(1, stats["tokens_total"]),
            "mean_service_ms": stats["service_ms"]["mean"]}


def row_line(row: dict) -> str:
    how = f"buckets {row['length_buckets']}" if row["length_buckets"] else "no buckets"
    if row["allowed_batch_sizes"]:
        how += f" + sizes {row['allowed_batch_sizes']}"
    return (f"max_batch {row['max_batch_size']:>3} {how:<45} | {row['rps']:>7.0f} req/s | "
            f"p50 {row['p50_ms']:>7.2f} ms p99 {row['p99_ms']:>7.2f} ms | avg batch "
            f"{row['avg_batch']:>5.1f} | padded/real tokens {row['padding_waste']:.2f} | "
            f"errors {row['errors']} wrong {row['wrong']} of {row['checked']} checked")


def run(setup: Setup, log=print) -> List[dict]:
    from engine import backends
    from engine.tools.onnx_model import build_encoder
    with tempfile.TemporaryDirectory(prefix="shmbatch-model-") as tmp:
        path = build_encoder(os.path.join(tmp, "encoder.onnx"), max_len=MAX_LEN)
        reference = backends.onnx(path, intra_op_threads=1)
        log(f"shmbatch bench --model onnx: a 2-block encoder (d=64) through ONNX Runtime "
            f"{_ort_version()} on the CPU, {setup.threads} intra-op thread; {setup.clients} "
            f"client processes x {setup.in_flight} in flight, {setup.seconds:g} s a row; "
            f"lengths 70 % 4-32, 25 % 33-80, 5 % 81-128 tokens")
        rows = []
        for b in setup.batch_sizes:
            # the shapes a compiled model would want: buckets, then also powers of two
            sizes = tuple(1 << k for k in range(b.bit_length()) if 1 << k <= b)
            variants = [(None, None), (BUCKETS, None)] + ([(BUCKETS, sizes)] if b > 2 else [])
            for buckets, allowed in variants:
                row = run_row(path, b, buckets, setup, reference, allowed)
                rows.append(row)
                log(row_line(row))
    return rows


def _ort_version() -> str:
    import onnxruntime
    return onnxruntime.__version__
