"""The tooling subcommands of `shmbatch`: bench, tune and manifest
(engine.tools does the work; imported only when one of them runs)."""
import argparse
import dataclasses
import itertools
import json
import os
import tomllib

from engine.cli.args import config_shape, key_values, knob_flag, knobs, numbers


def _backend_flags(p) -> None:
    """The backend and its input, as bench and tune take them (with the knobs' defaults)."""
    for knob in knobs():
        if knob.name in ("backend", "backend_args", "input_shape", "input_dtype"):
            knob_flag(p, knob, with_default=True)


def bench_parser(sub):
    p = sub.add_parser("bench", help="throughput and latency versus max_batch_size")
    _backend_flags(p)
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
    p.add_argument("--overload", action="store_true",
                   help="offer 0.5x-5x capacity and a burst, with deadlines: goodput, with "
                        "admission by deadline and without, side by side")
    p.add_argument("--slo-ms", type=float, default=100.0, help="--overload: each request's deadline")
    p.add_argument("--urgent-share", type=float, default=0.0,
                   help="--overload: share of requests sent at priority 0 (the rest at 1)")
    p.add_argument("--capacity", type=float, default=0.0, metavar="RPS",
                   help="--overload: the rows' 1x (default: measured first)")
    p.add_argument("--seconds", type=float,
                   help="--overload and --model: seconds per row (default 3; decoder: 8)")
    p.add_argument("--model", choices=("synthetic", "onnx", "decoder"), default="synthetic",
                   help="onnx: a transformer encoder built at run time, through ONNX Runtime "
                        "on the CPU, with and without length_buckets (needs .[onnx]); decoder: "
                        "a transformer decoder served the one-shot and the iterative way "
                        "(--backend-arg d_model=256: its engine.tools.decoder.Decoder arguments)")
    p.add_argument("--rates", type=numbers(float),
                   help="--model decoder: offered requests/s of the rows (default: 0.25x, 1x "
                        "and 3x the one-shot way's capacity)")
    p.add_argument("--http", action="store_true",
                   help="--model decoder: also the iterative engine served by `shmbatch serve`, "
                        "through generate_stream and /v1/completions (streamed, read by aiohttp)")
    p.add_argument("--baseline", action="store_true",
                   help="--model decoder: also bench/fastapi_stream_baseline.py, a FastAPI "
                        "streaming server doing the same model work, with continuous batching "
                        "and without (one request at a time)")
    p.add_argument("--no-one-shot", action="store_true",
                   help="--model decoder: leave out the one-shot way's rows")
    p.add_argument("--out", metavar="DIR", help="write DIR/bench.json and DIR/bench.png")


def _rows(args):
    from engine.tools import bench
    if args.batch_sizes is None and args.delays_ms is None:
        return bench.DEFAULT_ROWS
    return list(itertools.product(args.batch_sizes or [1, 2, 4, 8, 16, 32], args.delays_ms or [0.0]))


def _bench_model(args) -> int:

    from engine.tools import model_bench
    setup = model_bench.Setup(seconds=args.seconds or 3.0, seed=args.seed, clients=args.clients,
                              **({"batch_sizes": tuple(args.batch_sizes)} if args.batch_sizes else {}))
    rows = model_bench.run(setup)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "model.json"), "w") as f:
            json.dump({"setup": dataclasses.asdict(setup), "rows": rows}, f, indent=2)
        print(f"wrote {args.out}/model.json")
    return 0


def cmd_bench(args) -> int:
    from engine import tools
    from engine.tools import bench, closed_loop, procs
    from engine.tools.load import Load
    if args.out:
        tools.pyplot()  # the plot's dependency, asked for before minutes of measuring
    if args.model == "onnx":
        return _bench_model(args)
    if args.model == "decoder":
        from engine.tools import decoder_bench, decoder_http
        http = (decoder_http.GENERATE, decoder_http.OPENAI) * args.http + \
            (decoder_http.FASTAPI, decoder_http.FASTAPI_B1) * args.baseline
        result = decoder_bench.run(decoder_bench.Setup(
            seconds=args.seconds or 8.0, seed=args.seed, rates=args.rates and tuple(args.rates),
            model=key_values(args.backend_arg), one_shot=not args.no_one_shot, http=http,
            pin=not args.no_pin), out_dir=args.out)
        if args.out:
            print(f"\nwrote {args.out}/bench.json and {args.out}/bench.png")
        return 1 if any(r["wrong"] or r["answered"] < r["requests"] for r in result["rows"]) else 0
    if args.overload:
        if args.capacity < 0:
            raise SystemExit(f"shmbatch: --capacity: expected requests/s > 0, got {args.capacity:g}")
        from engine.tools import overload
        overload.run(overload.Setup(slo_ms=args.slo_ms, urgent_share=args.urgent_share,
                                    clients=args.clients, seconds=args.seconds or 3.0,
                                    seed=args.seed,
                                    capacity_rps=args.capacity),
                     out_dir=args.out)
        return 0
    backend_args = key_values(args.backend_arg)
    if args.backend == "engine.backends:synthetic":
        backend_args = {"fixed_ms": 2.0, "per_item_us": 100.0, **backend_args}
    load = Load(backend=args.backend, backend_args=backend_args,
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
            for system in procs.SYSTEMS[1:]:
                base = bench.run_row(row["max_batch_size"], row["max_delay_ms"], load, system=system)
                result["compare"].append(base)
                print(bench.compare_line(row, base), flush=True)
        print("\nthe engine's own overhead (identity backend, closed loops):")
        ident = dataclasses.replace(load, backend="engine.backends:identity", backend_args={})
        result["overhead"] = closed_loop.overhead(ident, seconds=args.overhead_seconds)
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


TUNE_KEYS = ("backend", "backend_args", "input_shape", "input_dtype", "max_input_shape",
             "output_shape", "output_dtype", "inputs", "outputs", "max_input_shapes",
             "length_buckets", "iterative", "max_steps", "sampling")


def tune_parser(sub):
    p = sub.add_parser("tune", help="measure S(n) and recommend max_batch_size / max_delay_ms",
                       description="Measures the backend's service time S(n) on random inputs "
                       "of the engine's shapes, in this process, and recommends the "
                       "max_batch_size with the most throughput within the SLO (and "
                       "max_delay_ms 0, with the delay the SLO would still allow); with "
                       "length_buckets, per bucket. An iterative engine's step time T(n) "
                       "gives the largest running batch that meets a time per output token "
                       "(--tpot-ms) and, if given, a time to first token (--ttft-ms). Takes "
                       "the backend and tensors as serve does: flags, or --config FILE.toml.")
    p.add_argument("--config", metavar="FILE.toml",
                   help="serve's config file: its backend and tensors; flags override")
    p.add_argument("--engine", metavar="NAME",
                   help="the [engines.NAME] table of --config to measure (a file of several)")
    for knob in knobs():
        if knob.name in TUNE_KEYS:
            knob_flag(p, knob)
    p.add_argument("--slo-ms", type=float, help="the latency budget of a one-shot engine's "
                   "request (an iterative engine reads it as --tpot-ms)")
    p.add_argument("--tpot-ms", type=float, help="iterative: the time per output token each "
                   "stream may take (a step of the running batch)")
    p.add_argument("--ttft-ms", type=float, help="iterative, optional: the time to a "
                   "request's first token (a join, its prefill, and a step)")
    p.add_argument("--max-batch", type=int, default=64, help="largest batch size measured")
    p.add_argument("--out", metavar="DIR", help="write DIR/tune.json and DIR/tune.png")


def tune_settings(args) -> dict:
    """The backend and tensors to measure: --config's keys (a multi-key serve
    file is fine: the rest are ignored), overridden by flags, then the
    knobs' defaults."""
    settings = {}
    if args.config:
        with open(args.config, "rb") as f:
            settings = tomllib.load(f)
        tables = settings.get("engines")
        if isinstance(tables, dict):  # a serve of several engines: the one named
            if args.engine is None and len(tables) == 1:  # or the only one
                args.engine = next(iter(tables))
            if args.engine not in tables:
                raise ValueError(f"{args.config}: expected --engine NAME, one of "
                                 f"{sorted(tables)}, got {args.engine!r}")
            settings = tables[args.engine]
        settings = {k: v for k, v in settings.items() if k in TUNE_KEYS}
    for key in TUNE_KEYS:
        value = getattr(args, key, None)
        if value is not None and key != "backend_args":
            settings[key] = value
    settings["backend_args"] = {**settings.get("backend_args", {}), **key_values(args.backend_arg)}
    settings.setdefault("backend", "engine.backends:synthetic")
    return settings


def tune_config(settings: dict):
    """The EngineConfig of the settings' tensors and shape knobs, validated as
    serve would (tune reads no output: named inputs without outputs are given
    a stand-in)."""
    from engine.config import EngineConfig
    shape_keys = ("iterative", "max_steps", "length_buckets", "sampling")
    knobs_given = {k: settings[k] for k in shape_keys if settings.get(k) is not None}
    if settings.get("inputs") is not None:
        return EngineConfig(name="tune", inputs=settings["inputs"],
                            outputs=settings.get("outputs") or {"unread": ["float32", []]},
                            max_input_shapes=settings.get("max_input_shapes"), **knobs_given)
    tensors = {k: settings[k] for k in ("input_shape", "input_dtype", "max_input_shape",
                                         "output_shape", "output_dtype") if k in settings}
    for key in ("input_shape", "max_input_shape", "output_shape"):
        if key in tensors:
            tensors[key] = config_shape(tensors[key], key)
    return EngineConfig(name="tune", **tensors, **knobs_given)


def tune_objectives(args, iterative: bool):
    """(slo_ms, tpot_ms, ttft_ms) as the engine's kind reads them; ValueError
    for a missing, misplaced or non-positive one."""
    given = {flag: v for flag, v in (("--slo-ms", args.slo_ms), ("--tpot-ms", args.tpot_ms),
                                      ("--ttft-ms", args.ttft_ms)) if v is not None}
    bad = [f"{flag} {v:g}" for flag, v in given.items() if not v > 0]
    if bad or args.max_batch < 1:
        raise ValueError(f"expected objectives > 0 ms and --max-batch >= 1, got "
                         f"{', '.join(bad) or f'--max-batch {args.max_batch}'}")
    if not iterative:
        if args.tpot_ms is not None or args.ttft_ms is not None:
            raise ValueError("--tpot-ms and --ttft-ms are an iterative engine's objectives "
                             "(iterative = true); a one-shot engine takes --slo-ms")
        if args.slo_ms is None:
            raise ValueError("expected --slo-ms MS, the latency budget of a request")
        return args.slo_ms, None, None
    if args.slo_ms is not None and args.tpot_ms is not None:
        raise ValueError("an iterative engine takes one time per output token: --tpot-ms, "
                         "or --slo-ms read as it; got both")
    tpot_ms = args.tpot_ms if args.tpot_ms is not None else args.slo_ms
    if tpot_ms is None:
        raise ValueError("an iterative engine's objective is the time per output token: "
                         "expected --tpot-ms MS (or --slo-ms, read as it)")
    return None, tpot_ms, args.ttft_ms


def cmd_tune(args) -> int:
    from engine.tools import tune
    settings = tune_settings(args)
    backend, backend_args = settings.pop("backend"), settings.pop("backend_args")
    cfg = tune_config(settings)
    slo_ms, tpot_ms, ttft_ms = tune_objectives(args, cfg.iterative)
    if cfg.iterative:
        from engine.tools import tune_steps
        if args.tpot_ms is None:
            print(f"reading --slo-ms {tpot_ms:g} as the time per output token (--tpot-ms)")
        tune_steps.run(backend, backend_args, cfg.input_specs, tpot_ms, ttft_ms,
                       limit=args.max_batch, max_steps=cfg.max_steps, out_dir=args.out,
                       sampling=cfg.sampling)
        return 0
    tune.run(backend, backend_args, cfg.input_specs, slo_ms, limit=args.max_batch,
             out_dir=args.out, buckets=cfg.length_buckets)
    return 0


MANIFEST_SYNOPSIS = """\
shmbatch manifest kubernetes --config models.toml --image IMAGE [--app-image IMG --app-command "CMD ARGS"]
                             [--replicas 2] [--autoscaler hpa|keda] [--target-queue-wait-ms 20]
                             [--autoscaler-metric vllm:num_requests_waiting --autoscaler-threshold 5]
                             [--max-replicas N] [--prometheus-url URL] [--run-as-user 1000]
                             [--name NAME] [--namespace NS] [--metrics-port 9090]
                             [--shm-headroom-mib 64] [--process-memory-mib 256]
                             [--memory-per-batcher SIZE | --measure [--memory-margin-mib 64]
                              [--memory-limit-factor 1.5]] [--api-key-secret SECRET]
shmbatch manifest kserve --config models.toml --image IMAGE [--name NAME] [--namespace NS] ...

Prints YAML (to stdout) that runs `shmbatch serve --config FILE` in a pod, its /dev/shm,
memory, probes and grace period sized from the config's engines; `manifest KIND --help`
tells each flag. Memory: --measure runs the config here and sizes it from what its
processes took; otherwise a budget per process, whose default is a guess."""


def manifest_parser(sub):
    p = sub.add_parser("manifest", help="Kubernetes or KServe YAML that runs a serve config",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=MANIFEST_SYNOPSIS)
    kinds = p.add_subparsers(dest="kind", required=True)
    k8s = kinds.add_parser("kubernetes", help="a ConfigMap, a Deployment, a Service for the "
                           "HTTP port, and an autoscaler on queue wait")
    kserve = kinds.add_parser("kserve", help="a ConfigMap and a KServe ServingRuntime (v2)")
    for q in (k8s, kserve):
        q.add_argument("--config", required=True, metavar="FILE.toml", help="serve's config")
        q.add_argument("--image", required=True, help="an image with shmbatch and the backends")
        q.add_argument("--name", help="the objects' name (default: the engine's, or the file's)")
        q.add_argument("--namespace", help="the objects' namespace (default: kubectl's)")
        q.add_argument("--metrics-port", type=int, metavar="PORT",
                       help="/metrics, for Prometheus and the autoscaler (default: the "
                            "config's metrics_port, else 9090)")
        q.add_argument("--shm-headroom-mib", type=int, metavar="MIB",
                       help="/dev/shm beyond the segments, for the pod's other users "
                            "(default 64)")
        q.add_argument("--process-memory-mib", type=int, metavar="MIB",
                       help="memory per serve process (supervisor, batcher, HTTP worker) "
                            "beside /dev/shm (default 256: a guess; see --measure)")
        q.add_argument("--memory-per-batcher", metavar="SIZE",
                       help="memory per batcher (2Gi, 1500Mi), the model's process, in place "
                            "of --process-memory-mib")
        q.add_argument("--measure", action="store_true",
                       help="start the config's engines here as serve does (with warmup), "
                            "send each full batches of its largest requests (and through "
                            "every HTTP worker), read each process's memory (PSS + swap, "
                            "/dev/shm left out), stop them, and size the memory from it: "
                            "request = measured + margin, limit = measured x factor "
                            "(beside /dev/shm's emptyDir)")
        q.add_argument("--memory-margin-mib", type=int, metavar="MIB",
                       help="--measure: the request over what was measured (default 64)")
        q.add_argument("--memory-limit-factor", type=float, metavar="X",
                       help="--measure: the limit, x what was measured (default 1.5)")
        q.add_argument("--api-key-secret", metavar="SECRET",
                       help="serve's API key (SHMBATCH_API_KEY) from this Secret's key "
                            "api-key: every HTTP route but the health probes needs it")
    k8s.add_argument("--app-image", help="the app's container (a Client of the engines)")
    k8s.add_argument("--app-command", metavar='"CMD ARGS"', help="the app container's command")
    k8s.add_argument("--replicas", type=int, default=2)
    k8s.add_argument("--max-replicas", type=int, help="the autoscaler's bound (default: "
                                                      "4 x --replicas, at least 10)")
    k8s.add_argument("--autoscaler", choices=("none", "hpa", "keda"), default="none",
                     help="hpa: a pods metric from prometheus-adapter; keda: a ScaledObject "
                          "with a Prometheus trigger")
    k8s.add_argument("--target-queue-wait-ms", type=float, metavar="MS",
                     help="the p90 queue wait the autoscaler holds (default 20)")
    k8s.add_argument("--autoscaler-metric", metavar="NAME",
                     help="keda: scale on this family of `serve --metrics-compat` instead "
                          "(vllm:num_requests_waiting, nv_inference_pending_request_count, "
                          "...: serve gets the flag); a gauge is summed over the pods' "
                          "engines, a counter's rate too, a histogram's p90 taken")
    k8s.add_argument("--autoscaler-threshold", type=float, metavar="X",
                     help="keda, with --autoscaler-metric: the value it holds (a gauge's or a "
                          "counter's per pod, a histogram's p90 in its unit)")
    k8s.add_argument("--prometheus-url", help="keda: the Prometheus server it queries")
    k8s.add_argument("--run-as-user", type=int, metavar="UID",
                     help="the pod's user: serve and the app share it, as a segment is its "
                          "creator's alone (default 1000)")


def cmd_manifest(args, plan) -> int:
    """Prints the manifest; plan is serve's reading of a config
    (engine.cli.commands.serve_plan). Nothing is printed unless all of it is made."""
    import pathlib
    import sys

    from engine.tools import manifest, manifest_kserve, manifest_pod
    from engine.tools.manifest_pod import MIB, or_default
    with open(args.config, encoding="utf-8") as f:
        text = f.read()
    engines, serve = plan(argparse.Namespace(config=args.config, backend_arg=None))
    kserve = args.kind == "kserve"
    margin_mib = or_default(args.memory_margin_mib, manifest_pod.DEFAULT_MARGIN_MIB)
    factor = or_default(args.memory_limit_factor, manifest_pod.DEFAULT_LIMIT_FACTOR)
    if args.measure and args.memory_per_batcher is not None:
        raise ValueError("--memory-per-batcher with --measure: expected one of them (the "
                         "measure sizes the batchers)")
    if not args.measure and (args.memory_margin_mib, args.memory_limit_factor) != (None, None):
        raise ValueError("--memory-margin-mib and --memory-limit-factor size what --measure "
                         "measured: expected --measure, got neither")
    if margin_mib < 0 or not factor >= 1:
        raise ValueError(f"expected --memory-margin-mib >= 0 and --memory-limit-factor >= 1, "
                         f"got {margin_mib} and {factor:g}")
    pod = manifest_pod.serve_pod(
        engines, serve, name=args.name, image=args.image, metrics_port=args.metrics_port,
        headroom_mib=or_default(args.shm_headroom_mib, manifest_pod.DEFAULT_HEADROOM_MIB),
        process_mib=or_default(args.process_memory_mib, manifest_pod.DEFAULT_PROCESS_MIB),
        http_port=manifest_kserve.HTTP_PORT if kserve else None,
        fallback_name=pathlib.Path(args.config).stem, api_key_secret=args.api_key_secret,
        batcher_bytes=None if args.memory_per_batcher is None else manifest_pod.size_bytes(
            args.memory_per_batcher, "--memory-per-batcher"))

    def make() -> str:
        if kserve:
            return manifest_kserve.kserve(pod, text, namespace=args.namespace)
        return manifest.kubernetes(
            pod, text, namespace=args.namespace, replicas=args.replicas,
            app_image=args.app_image, app_command=args.app_command, autoscaler=args.autoscaler,
            target_queue_wait_ms=args.target_queue_wait_ms, max_replicas=args.max_replicas,
            prometheus_url=args.prometheus_url or manifest.DEFAULT_PROMETHEUS_URL,
            run_as_user=or_default(args.run_as_user, manifest_pod.DEFAULT_RUN_AS_USER),
            autoscaler_metric=args.autoscaler_metric,
            autoscaler_threshold=args.autoscaler_threshold)
    out = make()  # every check first: minutes of a model's start are not spent on a typo
    if args.measure:
        from engine.tools import manifest_measure
        print(f"shmbatch manifest: measuring: serve --config {args.config}, with warmup ...",
              file=sys.stderr, flush=True)
        pod.measured = manifest_measure.measure(pod, args.config, margin_bytes=margin_mib * MIB,
                                                limit_factor=factor)
        print(f"shmbatch manifest: measured {pod.measured.total_mib} MiB in "
              f"{len(pod.measured.processes)} processes", file=sys.stderr, flush=True)
        out = make()
    sys.stdout.write(out)
    return 0


def dashboard_parser(sub):
    p = sub.add_parser("dashboard", help="a Grafana dashboard of the /metrics families (JSON "
                       "on stdout: shmbatch dashboard > grafana.json)")
    p.add_argument("--title", default="shmbatch", help="the dashboard's title")
    p.add_argument("--uid", default="shmbatch", help="the dashboard's uid (one per copy)")


def cmd_dashboard(args) -> int:
    import sys

    from engine.tools import dashboard
    sys.stdout.write(dashboard.text(args.title, args.uid))
    return 0
