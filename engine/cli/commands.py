"""The `shmbatch` command: serve, status, reload, cleanup, bench, tune, manifest, dashboard."""
import json
import os
import signal
import sys
import tomllib

from engine.cli import tooling
from engine.cli.args import (
    SERVE_ONLY_KEYS,
    Parser,
    engine_settings,
    flag_of,
    key_values,
    knob_flag,
    knobs,
    metrics_flags,
)
from engine.errors import EngineError
from engine.http import auth


def _serve_parser(sub):
    p = sub.add_parser("serve", help="run engines in the foreground until SIGINT/SIGTERM")
    p.add_argument("--config", metavar="FILE.toml",
                   help="the keys of engine.Engine(...), or [engines.NAME] tables of them (one "
                        "engine each, all served); flags override")
    for knob in knobs():
        knob_flag(p, knob)
    metrics_flags(p)
    p.add_argument("--http-port", type=int, metavar="PORT",
                   help="serve the Open Inference Protocol (KServe v2 REST) for every engine "
                        "on this port (0: any free one); needs the http extra")
    p.add_argument("--http-host", help="address for --http-port (default 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, metavar="PORT",
                   help="also serve the Open Inference Protocol over gRPC (Triton's "
                        "inference.GRPCInferenceService) on this port, in the HTTP workers (0: "
                        "any free one); needs --http-port and the grpc extra")
    p.add_argument("--grpc-host", help="address for --grpc-port (default 127.0.0.1)")
    p.add_argument("--http-workers", type=int, metavar="N",
                   help="HTTP worker processes, each a Client of every engine (default 1)")
    p.add_argument("--http-timeout-s", type=float, metavar="S",
                   help="the deadline of an infer without a timeout parameter (default 30)")
    p.add_argument("--http-max-body-bytes", type=int, metavar="N",
                   help="a larger request body is refused (413) before it is read (default: "
                        "each engine's, from its queue_capacity and tensors)")
    p.add_argument("--http-read-timeout-s", type=float, metavar="S",
                   help="a request's head and body must come within S s of its first byte (of "
                        "the connection's opening, for the first): a silent connection is "
                        "closed, a half-sent request answered 408 (default 15)")
    p.add_argument("--http-max-connections", type=int, metavar="N",
                   help="open connections per HTTP worker; one more is answered 503 at once "
                        "(default 1024, lower if the open-file limit requires)")
    p.add_argument("--api-key", metavar="KEY",
                   help="every route of --http-port but /health and /v2/health/* then needs "
                        "'Authorization: Bearer KEY' (401 otherwise); the flag wins over the "
                        f"{auth.ENV} environment variable, which wins over api_key in --config. "
                        "A flag shows in the process list: prefer the variable")
    p.add_argument("--model-control", choices=("none", "explicit"),
                   help="explicit: POST /v2/repository/models/NAME/load (start, or reload with "
                        "a new config) and /unload (drain, then stop) on --http-port, as "
                        "Triton's mode of that name; none (the default): the engines are "
                        "fixed at serve time")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", default="text", help="text, or json: one JSON object per "
                   "line on stderr (ts, level, engine, event, fields), from every process")


def _read_config(path: str) -> dict:
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: {e}") from None


def serve_plan(args):
    """(each engine's settings, serve's own settings): from the flags, or a
    TOML file of one engine's keys or of [engines.NAME] tables, flags
    overriding its keys."""
    settings = _read_config(args.config) if args.config else {}
    serve = {k: settings.pop(k) for k in SERVE_ONLY_KEYS if k in settings}
    serve.update({k: getattr(args, k) for k in SERVE_ONLY_KEYS
                  if getattr(args, k, None) is not None})
    tables = settings.pop("engines", None)
    if tables is None:
        openai = settings.pop("openai", None)  # this engine also on the OpenAI API
        engine = engine_settings(settings, args, args.config)
        if openai is not None:
            serve["openai"] = {engine["name"]: openai}
        return [engine], serve
    where = args.config
    if settings:
        raise ValueError(f"{where}: top-level key(s) {', '.join(sorted(settings))} beside "
                         f"[engines.NAME] tables; the top level holds serve's own keys "
                         f"({', '.join(SERVE_ONLY_KEYS)}), each engine's knobs go in its table")
    given = [k.name for k in knobs()
             if getattr(args, "backend_arg" if k.name == "backend_args" else k.name, None)
             is not None]
    if given:
        raise ValueError(f"{', '.join(flag_of(k) for k in given)}: {where} has [engines.NAME] "
                         f"tables; set each engine's knobs in its table")
    if not isinstance(tables, dict) or not tables or \
            not all(isinstance(t, dict) for t in tables.values()):
        raise ValueError(f"{where}: expected [engines.NAME] tables of engine.Engine(...)'s keys, "
                         f"got engines = {tables!r}")
    engines, openai = [], {}
    for name, table in tables.items():
        if table.get("name", name) != name:
            raise ValueError(f"{where}: engine {name!r}: the table's name is the engine's, "
                             f"got name = {table['name']!r}")
        table = dict(table)
        if "openai" in table:  # [engines.NAME.openai]: this engine also on the OpenAI API
            openai[name] = table.pop("openai")
        engines.append(engine_settings({**table, "name": name}, None, f"{where}: engine {name!r}"))
    if openai:
        serve["openai"] = openai
    return engines, serve


def serve_settings(args) -> dict:
    """One engine's settings and serve's own: the TOML file's keys,
    overridden by flags."""
    engines, serve = serve_plan(args)
    if len(engines) != 1:
        raise ValueError(f"{args.config}: expected one engine, got [engines.NAME] tables of "
                         f"{len(engines)}")
    return {**engines[0], **serve}


def _api_key_of_environment(args, serve: dict) -> None:
    """SHMBATCH_API_KEY as serve's api_key, unless --api-key gave one (on an
    HTTP port only: the variable may be set for other commands too); taken
    out of serve's environment, so that no process serve starts inherits it."""
    key = os.environ.pop(auth.ENV, None)
    if key is not None and args.api_key is None and serve.get("http_port") is not None:
        serve["api_key"] = key


def cmd_serve(args) -> int:
    import logging
    import select

    from engine import logfmt
    from engine.cli.serve import Serving
    from engine.serving import notify
    logfmt.configure(args.log_level, args.log_format)
    log = logging.getLogger("shmbatch")
    engines, serve = serve_plan(args)
    _api_key_of_environment(args, serve)
    serving = Serving(engines, **serve)  # validates every engine, creates nothing
    names = ", ".join(serving.names)
    # a signal wakes the loop below by a byte on this pipe: a handler that took a lock
    # (Event.set) could wait forever on the one the main thread held when interrupted
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    serving.start()
    try:
        print(serving.ready_line(), flush=True)
        what = "engine" if len(serving.names) == 1 else "engines"
        notify.sd_notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS={what} {names} ready")
        while not select.select([woken], [], [], 1.0)[0]:
            serving.watch()
        log.info("%s %s: signal received; draining", what, names,
                 extra={"engine": names} if len(serving.names) == 1 else None)
        notify.sd_notify(f"STOPPING=1\nSTATUS={what} {names} draining")
    finally:
        serving.stop()
    return 0


def _status_parser(sub):
    p = sub.add_parser("status", help="live figures of a running engine")
    p.add_argument("name")
    p.add_argument("--json", action="store_true")
    p.add_argument("--ready", action="store_true",
                   help="print the state only, and exit 0 only while the engine serves: it "
                        "runs and a live batcher has loaded its model (a readiness probe; "
                        "reads the header page alone)")


def state_name(state: int) -> str:
    from engine.shm import codes
    return {codes.ENGINE_STARTING: "starting", codes.ENGINE_RUNNING: "running",
            codes.ENGINE_STOPPING: "stopping", codes.ENGINE_STOPPED: "stopped"}.get(
                state, f"state word {state}: written by another process")


def cmd_status(args) -> int:
    from engine.segment import Segment
    from engine.serving import metrics, processes
    from engine.shm import codes
    seg = Segment.attach(args.name, header_only=True)
    if args.ready:  # as the HTTP routes' readiness: a live batcher has loaded its model
        try:
            state, alive, serves = seg.engine_state(), seg.holder_alive(), seg.serves()
        finally:
            seg.close()
        said = state_name(state) if alive else "dead"
        if alive and state == codes.ENGINE_RUNNING and not serves:
            said += ", not ready: no live batcher has loaded its model yet"
        print(f"engine {args.name!r} {said}")
        return 0 if serves else 1
    if seg.holder_alive():  # running: every figure, the slots' included
        seg.close()
        seg = Segment.attach(args.name)
    try:
        stats = metrics.read_stats(seg)
        alive = seg.holder_alive()
        state = state_name(seg.engine_state())
        stats["state"] = state if alive else f"dead (run: shmbatch cleanup {args.name})"
        stats["supervisor_pid"] = seg.ring.word(codes.W_SUPERVISOR_PID)
    finally:
        seg.close()
    pools, why = thread_pools(args.name) if alive else (None, "the engine is dead")
    stats.update(threads=pools, threads_unknown=why, warmup_ms=processes.slowest_warmup_ms(pools or []))
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print(status_table(stats))
    return 0 if alive else 1


THREADS_TIMEOUT_S = 2.0  # a reload in progress holds the control socket: status does not wait


def thread_pools(name: str):
    """(each live batcher's thread pools, None) as the engine's control socket
    answers, or (None, why not)."""
    from engine.serving import control
    try:
        reply = control.request(name, {"op": "threads"}, timeout_s=THREADS_TIMEOUT_S)
    except (EngineError, OSError, ValueError) as e:  # TimeoutError is an OSError
        return None, str(e)
    if not reply.get("ok"):
        return None, str(reply.get("error", "the engine gave no reason"))
    return reply["threads"], None


def thread_rows(s: dict) -> list:
    """Rows of the status table: each batcher's thread pools, and advice when
    those of the unpinned ones leave no core to the web workers and clients."""
    from engine.batching import threads
    if s.get("threads") is None:
        return [("threads", f"not known ({s.get('threads_unknown')})")]
    if not s["threads"]:
        return [("threads", "no live batcher has loaded its model")]
    rows = [("threads", f"batcher {r['batcher']} (pid {r['pid']}): {threads.describe(r)}")
            for r in s["threads"]]
    advice = threads.advice(s["threads"])
    return rows + ([("advice", advice)] if advice else [])


def status_table(s: dict) -> str:
    from engine.segment import size_text
    q, sv = s["queue_wait_ms"], s["service_ms"]
    slots = ("slots not read (the engine is dead)" if s["slots_in_use"] is None else
             f"{s['queue_depth']} waiting, {s['slots_in_use']} slots in use")
    rows = [
        ("engine", f"{s['name']} ({s['state']}, supervisor pid {s['supervisor_pid']})"),
        ("batchers", f"{s['instances_alive']} of {s['instances']} alive, pids {s['batcher_pids']}"),
        ("knobs", f"max_batch_size {s['max_batch_size']}, max_delay_ms {s['max_delay_ms']:g}, "
                  f"queue_capacity {s['queue_capacity']}"),
        ("requests", f"{s['requests_total']} queued in all: {s['answered_total']} answered, "
                     f"{s['errors_total']} failed, {s['expired_total']} expired, "
                     f"{s['timeouts_total']} timed out, {s['withdrawn_total']} withdrawn "
                     f"(the rest in flight); refused at the door: {s['rejected_total']} queue "
                     f"full, {s['overloaded_total']} by admission; {s['invalid_total']} invalid"),
        ("queue", f"{slots} of {s['queue_capacity']}, segment {size_text(s['segment_bytes'])}"),
        ("batches", f"{s['batches_total']} run, avg size {s['avg_batch_size']:.2f}, "
                    f"{s['zero_copy_batches']} zero-copy, {s['gathered_batches']} gathered"),
        ("queue wait", f"p50 {q['p50']:.3f} ms  p99 {q['p99']:.3f} ms  max {q['max']:.3f} ms"),
        ("service", f"p50 {sv['p50']:.3f} ms  p99 {sv['p99']:.3f} ms  max {sv['max']:.3f} ms"),
        ("scheduling", f"batch limit {s['batch_limit']}, "
                       f"{s['isolated_failures_total']} failed alone after a split"),
        ("admission", admission_text(s["admission"])),
        ("faults", f"{s['batcher_restarts_total']} batcher restarts, "
                   f"{s['reclaimed_slots_total']} slots reclaimed from dead clients"),
    ]
    if s["steps_total"]:  # an iterative engine's running batches and streams
        t, c = s["ttft_ms"], s["chunk_ms"]
        rows.append(("streams", f"{s['active']} running, {s['steps_total']} steps, "
                                f"{s['chunks_total']} chunks; first chunk p50 {t['p50']:.3f} ms "
                                f"p99 {t['p99']:.3f} ms; between chunks p50 {c['p50']:.3f} ms "
                                f"p99 {c['p99']:.3f} ms"))
    if "threads" in s:
        rows += thread_rows(s)
    if s["corrupt_total"]:  # any at all: no engine process writes such a value
        rows.append(("CORRUPT", f"{s['corrupt_total']} values in the segment failed their "
                                f"checks: another process writes into it"))
    return "\n".join(f"{k:>11}  {v}" for k, v in rows)


def admission_text(a: dict) -> str:
    """Admission by deadline's account of itself: its refusals, and how the
    waits it predicted compared with those seen (so its 503s are told from
    an engine that is simply full)."""
    if not a["calibrated"]:
        return f"{a['refused_total']} refused; not calibrated yet (refuses nothing until it is)"
    text = f"{a['refused_total']} refused"
    if a["compared_total"]:
        text += (f"; of {a['compared_total']} admitted on a counted prediction, waits predicted "
                 f"{a['predicted_ms_mean']:.1f} ms and seen {a['seen_ms_mean']:.1f} ms on average, "
                 f"{100 * a['late_total'] / a['compared_total']:.0f} % longer than predicted")
    return text + f"; predictions corrected x{a['correction']:.2f}"


def _cleanup_parser(sub):
    p = sub.add_parser("cleanup", help="remove the segment of a dead engine")
    p.add_argument("name")


def cmd_cleanup(args) -> int:
    import psutil

    from engine import segment
    from engine.errors import EngineUnavailable
    from engine.shm import codes, liveness
    try:  # the header page only: a leftover of any size goes without touching its memory
        seg = segment.Segment.attach(args.name, header_only=True)
    except EngineUnavailable:
        seg = None  # absent, or not a valid segment: the lock decides below
    if seg is not None:
        try:
            if seg.holder_alive():
                raise segment.EngineAlreadyRunning(
                    f"engine {args.name!r} is already running (supervisor pid "
                    f"{seg.ring.word(codes.W_SUPERVISOR_PID)}); stop it instead")
            r = seg.ring
            # both banks: a reload's old and new batchers hold different numbers
            numbers = range(min(2 * seg.config.instances, codes.MAX_INSTANCES))
            batchers = [(r.word(codes.W_BATCHER_PID + i), r.word(codes.W_BATCHER_START + i))
                        for i in numbers]
        finally:
            seg.close()
        live = [pid for pid, ticks in batchers if pid and liveness.is_alive(pid, ticks)]
        if live:  # they die with their supervisor (parent-death signal): give them a moment
            _, still = psutil.wait_procs([psutil.Process(p) for p in live if psutil.pid_exists(p)],
                                         timeout=3)
            if still:
                raise segment.EngineAlreadyRunning(f"engine {args.name!r} still has live "
                                                  f"batchers {[p.pid for p in still]}")
    if not segment.remove_if_dead(args.name):
        raise EngineUnavailable(f"no engine named {args.name!r} (nothing in /dev/shm)")
    print(f"removed /dev/shm{segment.segment_name(args.name)}")
    return 0


RELOAD_TIMEOUT_S = 600.0


def _reload_parser(sub):
    p = sub.add_parser(
        "reload", help="new batchers (new backend args or weights, or a new backend) take over "
                       "a running engine; no request is lost or refused",
        description="Starts new batchers beside the running engine's, and hands them the queue "
                    "once they are ready (Engine.reload). --backend-arg K=V are merged over the "
                    "engine's current backend args (unlike Engine.reload(backend_args=...), "
                    "which replaces them); with no flag, the same factory runs again (e.g. to "
                    "read new weights). If a new batcher fails to start, the old ones keep "
                    "serving and this exits 1 with the reason.")
    p.add_argument("name")
    p.add_argument("--backend", metavar="MOD:FACTORY", help="a new backend (default: the current one)")
    p.add_argument("--backend-arg", action="append", metavar="KEY=VALUE",
                   help="a backend arg, merged over the current ones; repeated")
    p.add_argument("--timeout", type=float, default=RELOAD_TIMEOUT_S, metavar="SECONDS",
                   help=f"wait at most this long for the engine's answer (default "
                        f"{RELOAD_TIMEOUT_S:g})")


def cmd_reload(args) -> int:
    from engine.serving import control
    reply = control.request(args.name, {"op": "reload", "backend": args.backend,
                                        "backend_args": key_values(args.backend_arg)},
                            timeout_s=args.timeout)
    if not reply.get("ok"):
        print(f"shmbatch reload: {reply.get('error', 'the engine gave no reason')}", file=sys.stderr)
        return 1
    print(f"shmbatch reload: engine {args.name!r} reloaded (epoch {reply.get('epoch')}, "
          f"batchers {reply.get('batcher_pids')})")
    return 0


def main(argv=None) -> int:
    parser = Parser(prog="shmbatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _status_parser(sub)
    _reload_parser(sub)
    _cleanup_parser(sub)
    tooling.bench_parser(sub)
    tooling.tune_parser(sub)
    tooling.manifest_parser(sub)
    tooling.dashboard_parser(sub)
    args = parser.parse_args(argv)
    # a backend module in the working directory imports, as under gunicorn and uvicorn
    # (a console script's sys.path[0] is its own folder)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    # SIGTERM unwinds like Ctrl-C, so engines stop and their segments go
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return {"serve": cmd_serve, "status": cmd_status, "reload": cmd_reload,
                "cleanup": cmd_cleanup, "bench": tooling.cmd_bench, "tune": tooling.cmd_tune,
                "manifest": lambda a: tooling.cmd_manifest(a, serve_plan),
                "dashboard": tooling.cmd_dashboard}[args.command](args)
    except KeyboardInterrupt:
        return 130
    except (EngineError, ValueError, RuntimeError, OSError) as e:
        print(f"shmbatch {args.command}: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # still one line: the reason, not a traceback
        print(f"shmbatch {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    raise SystemExit(main())
