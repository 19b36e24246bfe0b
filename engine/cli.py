"""The `shmbatch` command (contract section 4): bench and tune; serve, status
and cleanup come with the sidecar."""
import argparse
import dataclasses
import itertools
import signal
import sys
import tomllib

from engine import bench
from engine.errors import EngineError


def toml_value(text: str):
    """A --backend-arg value: a TOML value where it parses as one, else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def key_values(pairs) -> dict:
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"shmbatch: expected KEY=VALUE, got {pair!r}")
        out[key.strip()] = toml_value(value.strip())
    return out


def shape(text: str):
    try:
        return tuple(None if d.strip().lower() == "none" else int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shape like 128,3, got {text!r}") from None


def numbers(kind):
    def parse(text: str):
        try:
            return [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    return parse


def _bench_parser(sub):
    p = sub.add_parser("bench", help="throughput and latency versus max_batch_size")
    p.add_argument("--backend", default="engine.backends:synthetic")
    p.add_argument("--backend-arg", action="append", metavar="KEY=VALUE")
    p.add_argument("--input-shape", type=shape, default=(16,))
    p.add_argument("--input-dtype", default="float32")
    p.add_argument("--batch-sizes", type=numbers(int), help="e.g. 1,2,4,8,16,32")
    p.add_argument("--delays-ms", type=numbers(float), help="e.g. 0,1,2")
    p.add_argument("--rate", type=float, default=1500.0, help="offered requests/s, all clients")
    p.add_argument("--clients", type=int, default=4, help="client processes")
    p.add_argument("--requests", type=int, default=1600, help="requests per row, all clients")
    p.add_argument("--queue-capacity", type=int, help="default: room for every request")
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-pin", action="store_true", help="do not pin batchers and clients apart")
    p.add_argument("--saturate", action="store_true",
                   help="find the highest rate served with a bounded queue, per max_batch_size")
    p.add_argument("--compare", action="store_true",
                   help="also run two multiprocessing baselines, and the engine's own overhead")
    p.add_argument("--overhead-seconds", type=float, default=2.0)
    p.add_argument("--out", metavar="DIR", help="write DIR/bench.json and DIR/bench.png")


def _rows(args):
    if args.batch_sizes is None and args.delays_ms is None:
        return bench.DEFAULT_ROWS
    return list(itertools.product(args.batch_sizes or [1, 2, 4, 8, 16, 32], args.delays_ms or [0.0]))


def cmd_bench(args) -> int:
    backend_args = key_values(args.backend_arg)
    if args.backend == "engine.backends:synthetic":
        backend_args = {"fixed_ms": 2.0, "per_item_us": 100.0, **backend_args}
    load = bench.Load(backend=args.backend, backend_args=backend_args,
                      input_shape=args.input_shape, dtype=args.input_dtype, clients=args.clients,
                      rate=args.rate, requests=args.requests, queue_capacity=args.queue_capacity,
                      seed=args.seed, pin=not args.no_pin)
    rows = _rows(args)
    result = {"config": {**dataclasses.asdict(load), "rows": rows, "instances": args.instances},
              "environment": bench.environment(), "rows": []}
    print(f"shmbatch bench: {args.backend} {backend_args or ''}; {args.clients} client processes, "
          f"{args.rate:g} req/s Poisson (open loop) in all, {args.requests} requests a row")
    for b, d in rows:
        row = bench.run_row(b, d, load, instances=args.instances)
        result["rows"].append(row)
        print(bench.row_line(row), flush=True)
    if args.compare:
        print("\nthe same load through the multiprocessing baselines (ratio = shmbatch / baseline):")
        result["compare"] = []
        for row in result["rows"]:
            for system in bench.SYSTEMS[1:]:
                base = bench.run_row(row["max_batch_size"], row["max_delay_ms"], load, system=system)
                result["compare"].append(base)
                print(bench.compare_line(row, base), flush=True)
        print("\nthe engine's own overhead (identity backend, closed loops):")
        ident = dataclasses.replace(load, backend="engine.backends:identity", backend_args={})
        result["overhead"] = bench.overhead(ident, seconds=args.overhead_seconds)
    if args.saturate:
        print("\ncapacity (highest rate served with a bounded queue):")
        result["saturation"] = []
        for b in sorted({b for b, _ in rows}):
            d = min(dd for bb, dd in rows if bb == b)
            sat = bench.saturate(b, d, load)
            result["saturation"].append(sat)
            theory = ""
            if args.backend == "engine.backends:synthetic":
                cap = bench.theoretical_rps(b, float(backend_args["fixed_ms"]),
                                            float(backend_args["per_item_us"]))
                theory = f" = {100 * sat['capacity_rps'] / cap:.0f} % of n / S(n) = {cap:,.0f}"
            print(f"max_batch {b:>3} delay {d:g} ms: {sat['capacity_rps']:,.0f} req/s{theory}", flush=True)
    if args.out:
        bench.write_outputs(args.out, result, load)
        print(f"\nwrote {args.out}/bench.json and {args.out}/bench.png")
    bad = sum(r["wrong"] + r["lost"] for r in result["rows"])
    return 1 if bad else 0


def _tune_parser(sub):
    p = sub.add_parser("tune", help="measure S(n) and recommend max_batch_size / max_delay_ms")
    p.add_argument("--backend", default="engine.backends:synthetic")
    p.add_argument("--backend-arg", action="append", metavar="KEY=VALUE")
    p.add_argument("--input-shape", type=shape, default=(16,))
    p.add_argument("--input-dtype", default="float32")
    p.add_argument("--slo-ms", type=float, required=True, help="the latency budget")
    p.add_argument("--max-batch", type=int, default=64, help="largest batch size measured")
    p.add_argument("--out", metavar="DIR", help="write DIR/tune.json and DIR/tune.png")


def cmd_tune(args) -> int:
    from engine import tune
    if None in args.input_shape:
        raise ValueError("tune needs a fixed --input-shape (the padded shape of a batch)")
    tune.run(args.backend, key_values(args.backend_arg), args.input_shape, args.input_dtype,
             args.slo_ms, limit=args.max_batch, out_dir=args.out)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="shmbatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _bench_parser(sub)
    _tune_parser(sub)
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so engines stop and their segments go
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return {"bench": cmd_bench, "tune": cmd_tune}[args.command](args)
    except KeyboardInterrupt:
        return 130
    except (EngineError, ValueError, RuntimeError, OSError) as e:
        print(f"shmbatch {args.command}: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    raise SystemExit(main())
