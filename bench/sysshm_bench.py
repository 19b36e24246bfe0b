"""1 MiB float32 inputs by shared memory, binary data and JSON over HTTP (and gRPC), in one run.

    python bench/sysshm_bench.py [--seconds S] [--rounds R] [--clients 1,4] [--http-workers N]
                                 [--grpc]

`shmbatch serve --http-port 0` runs an identity engine on float32[262144]
(1 MiB a request; max_batch_size 8, queue_capacity 64). Each mode is a closed
loop of C client processes (tritonclient.http, one request in flight each) for
S seconds; the modes alternate, R rounds, so that a drift of the machine falls
on all of them. Per request, each mode pays its client's whole cost:
- shm: the input written into the client's own region (tritonclient's
  set_shared_memory_region), an infer whose input and output name regions,
  the output read back (get_contents_as_numpy, copied);
- binary: set_data_from_numpy(binary_data=True), the output as binary data;
- json: the input and the output as JSON numbers;
with --grpc (serve's --grpc-port too), through tritonclient.grpc:
- grpc-shm: as shm;
- grpc-raw: the input and the output as raw contents.
Every answer is checked against its own request (identity: equal to the
input, which differs each request). A row: requests/s (each loop's requests
over its own length, summed over the clients), p50 and
p99 of the request's wall time, and the wrong answers (none expected). Every
region is unregistered and destroyed, and serve stopped, before the end.
"""
import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

VALUES = 1 << 18  # float32: 1 MiB
TIMEOUT_S = 60.0


def client(url: str, model: str, mode: str, seconds: float, index: int, out) -> None:
    """One closed loop; puts (latencies in s, wrong, the loop's seconds) on out."""
    import tritonclient.utils.shared_memory as shm
    if mode.startswith("grpc"):  # url: the gRPC address
        import tritonclient.grpc as triton
        c = triton.InferenceServerClient(url)
    else:
        import tritonclient.http as triton  # type: ignore[no-redef]
        c = triton.InferenceServerClient(url, connection_timeout=TIMEOUT_S,
                                         network_timeout=TIMEOUT_S)
    shared = mode in ("shm", "grpc-shm")
    x = np.random.default_rng(index).standard_normal(VALUES).astype(np.float32)[None]
    handles = []
    if shared:
        for role in ("in", "out"):
            name = f"bench-{os.getpid()}-{role}"
            handles.append(shm.create_shared_memory_region(name, "/" + name, x.nbytes))
            c.register_system_shared_memory(name, "/" + name, x.nbytes)
    latencies, wrong = [], 0
    try:
        began = time.perf_counter()
        end = began + seconds
        k = 0
        while time.perf_counter() < end:
            k += 1
            x[0, 0] = k  # each request its own input
            start = time.perf_counter()
            i = triton.InferInput("INPUT", [1, VALUES], "FP32")
            o = triton.InferRequestedOutput("OUTPUT") if mode.startswith("grpc") else \
                triton.InferRequestedOutput("OUTPUT", binary_data=mode != "json")
            if shared:
                shm.set_shared_memory_region(handles[0], [x])
                i.set_shared_memory(f"bench-{os.getpid()}-in", x.nbytes)
                o.set_shared_memory(f"bench-{os.getpid()}-out", x.nbytes)
                c.infer(model, [i], outputs=[o])
                y = shm.get_contents_as_numpy(handles[1], np.float32, [1, VALUES]).copy()
            elif mode == "grpc-raw":
                i.set_data_from_numpy(x)
                y = c.infer(model, [i], outputs=[o]).as_numpy("OUTPUT")
            else:
                i.set_data_from_numpy(x, binary_data=mode == "binary")
                y = c.infer(model, [i], outputs=[o]).as_numpy("OUTPUT")
            latencies.append(time.perf_counter() - start)
            wrong += not np.array_equal(y, x)
        elapsed = time.perf_counter() - began
    finally:
        for h in handles:
            c.unregister_system_shared_memory(h._triton_shm_name)
            shm.destroy_shared_memory_region(h)
        c.close()
    out.put((latencies, wrong, elapsed))


def run_mode(url, model, mode, seconds, clients):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=client, args=(url, model, mode, seconds, n, out))
             for n in range(clients)]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(TIMEOUT_S)
    latencies = sorted(t for r in results for t in r[0])
    wrong = sum(r[1] for r in results)
    # each loop's own length: its last request may end past `seconds`
    return sum(len(r[0]) / r[2] for r in results), latencies, wrong


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--http-workers", type=int, default=1)
    ap.add_argument("--grpc", action="store_true", help="also over gRPC: regions, and raw")
    args = ap.parse_args()
    model = f"sysshm-bench-{os.getpid()}"
    folder = tempfile.mkdtemp()
    config = os.path.join(folder, "models.toml")
    with open(config, "w") as f:
        f.write(f"http_workers = {args.http_workers}\n[engines.\"{model}\"]\n"
                f"backend = \"engine.backends:identity\"\ninput_shape = [{VALUES}]\n"
                f"output_shape = [{VALUES}]\nmax_batch_size = 8\nqueue_capacity = 64\n")
    grpc_flags = ["--grpc-port", "0"] if args.grpc else []
    serve = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--config", config,
                              "--http-port", "0", *grpc_flags], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        url = None
        while url is None and time.monotonic() < deadline:
            line = serve.stdout.readline()
            if not line:
                raise SystemExit("serve exited before it was ready")
            found = re.search(r"http://(\S+?)(?: and gRPC (\S+))?$", line.strip())
            url = found.group(1) if "ready" in line and found else None
            grpc_at = found.group(2) if url else None
        if url is None:
            raise SystemExit("serve not ready in time")
        rows = []
        for clients in [int(c) for c in args.clients.split(",")]:
            for r in range(args.rounds):
                modes = ("shm", "binary", "json") + (("grpc-shm", "grpc-raw") if args.grpc else ())
                for mode in modes:
                    at = grpc_at if mode.startswith("grpc") else url
                    rate, lat, wrong = run_mode(at, model, mode, args.seconds, clients)
                    rows.append((clients, r, mode, rate, lat, wrong))
                    p50 = lat[len(lat) // 2] * 1e3
                    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3
                    print(f"{clients} client(s) round {r + 1} {mode:>8}: {rate:8.1f} req/s | "
                          f"p50 {p50:8.2f} ms p99 {p99:8.2f} ms | {len(lat)} requests | "
                          f"wrong {wrong}", flush=True)
    finally:
        serve.terminate()
        serve.wait(TIMEOUT_S)
    left = [n for n in os.listdir("/dev/shm") if model in n or n.startswith("bench-")]
    print(f"left in /dev/shm: {left or 'nothing'}")


if __name__ == "__main__":
    main()
