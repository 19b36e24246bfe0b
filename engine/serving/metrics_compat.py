"""vLLM's and Triton's metric names on /metrics (`serve --metrics-compat
vllm,triton`), so a dashboard or autoscaler recipe written for either reads
shmbatch unchanged.

Every figure is one the segment already holds (engine.serving.metrics reads
the same words), so the families need nothing from the engine and survive
what the segment survives: a batcher's restart and a reload keep it, and so
keep every counter monotonic. Written here rather than through
prometheus_client's families because Triton's counters carry no `_total`
suffix, which prometheus_client's exposition always adds: each family is
written as Triton and vLLM write it, in the text format 0.0.4.

vLLM's semantics on a one-shot engine: its answer is its first and only
output, so time to first token is its end-to-end time; tokens are counted
only where the engine has them (generation: an iterative engine's chunks;
prompt: the real lengths along a one-shot engine's variable dim).
"""
import math
from typing import Callable, Iterable, List, Sequence, Tuple

import numpy as np

from engine.shm import codes, ring

KINDS = ("vllm", "triton")
TRITON_VERSION = "1"  # every engine is one model of one version (as its HTTP routes say)

# vLLM's own buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                     60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Triton's failure reasons, each the shmbatch outcomes (stats() keys) it sums
FAILURE_REASONS = (
    ("REJECTED", ("rejected_total", "overloaded_total", "expired_total")),
    ("CANCELED", ("withdrawn_total",)),
    ("BACKEND", ("errors_total",)),
    ("OTHER", ("invalid_total", "timeouts_total")),
)
_UPPER_S = ring.hist_bounds_ns()[1] / 1e9


def parse(text) -> Tuple[str, ...]:
    """The kinds a --metrics-compat value names (a comma list; None or "" or
    "none": none), checked."""
    if text is None:
        return ()
    if isinstance(text, (list, tuple)):
        text = ",".join(text)
    if not isinstance(text, str):
        raise ValueError(f"metrics_compat: expected a comma list of {', '.join(KINDS)}, "
                         f"got {text!r}")
    kinds = [k.strip().lower() for k in text.split(",") if k.strip()]
    if kinds == ["none"]:
        return ()
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"--metrics-compat: expected a comma list of {', '.join(KINDS)} "
                         f"(or none), got {bad[0]!r}")
    return tuple(k for k in KINDS if k in kinds)  # each once, in a fixed order


def counts_prompt_tokens(config) -> bool:
    """Whether vllm:prompt_tokens_total counts this engine's: a one-shot
    engine with a variable dim has real lengths to count."""
    return not config.iterative and any(s.var_axis is not None for s in config.input_specs)


# the families some engines alone carry: the rule of which (an EngineConfig's), and why
ONLY_WHERE = {"vllm:prompt_tokens_total": (counts_prompt_tokens,
                                           "a one-shot engine with a variable dim counts it"),
              "vllm:generation_tokens_total": (lambda config: bool(config.iterative),
                                               "an iterative engine counts it")}


class Family:
    """One family of the text format: its HELP and TYPE once, then every
    engine's samples."""

    def __init__(self, name: str, kind: str, doc: str) -> None:
        self.name, self.kind, self.doc = name, kind, doc
        self.lines: List[str] = []

    def add(self, labels: dict, value: float, suffix: str = "") -> None:
        self.lines.append(f"{self.name}{suffix}{_labels(labels)} {_number(value)}")

    def add_histogram(self, labels: dict, counts: np.ndarray, bounds: Sequence[float],
                      sum_s: float) -> None:
        """Cumulative buckets from a ring histogram: a ring bucket counts under
        the first bound at or above its upper edge (never understated)."""
        for bound in bounds:
            self.add({**labels, "le": _number(bound)}, float(counts[_UPPER_S <= bound].sum()),
                     "_bucket")
        total = float(counts.sum())
        self.add({**labels, "le": "+Inf"}, total, "_bucket")
        self.add(labels, sum_s, "_sum")
        self.add(labels, total, "_count")

    def text(self) -> str:
        return "".join((f"# HELP {self.name} {self.doc}\n# TYPE {self.name} {self.kind}\n",
                        *(line + "\n" for line in self.lines)))


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    esc = lambda v: str(v).replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')  # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items())) + "}"


def _number(v: float) -> str:
    v = float(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


class Figures:
    """What the compat families read of one engine's segment, once per scrape."""

    def __init__(self, segment, stats: dict) -> None:
        r = segment.ring
        self.name, self.stats, self.config = segment.name, stats, segment.config
        ctl = np.zeros(segment.capacity, dtype=np.uint64)
        r.snapshot(ctl, np.zeros_like(ctl))
        states = ring.ctl_state(ctl)
        self.waiting = int((states == codes.READY).sum())
        self.running = int((states == codes.CLAIMED).sum())  # in a batch, or a running stream
        self.e2e = r.histogram(codes.H_E2E)
        self.e2e_sum_ns = r.stream_times(codes.H_E2E)[0]
        self.queue = r.histogram(codes.H_QUEUE_WAIT)
        self.queue_sum_ns = r.word(codes.W_QUEUE_WAIT_SUM_NS)
        self.served_ns = r.word(codes.W_SERVED_NS)
        self.iterative = bool(self.config.iterative)
        if self.iterative:
            self.ttft, self.ttft_sum_ns = r.histogram(codes.H_TTFT), r.stream_times(codes.H_TTFT)[0]
        else:  # a one-shot answer is its first output
            self.ttft, self.ttft_sum_ns = self.e2e, self.e2e_sum_ns
        self.prompt_tokens = counts_prompt_tokens(self.config)


def vllm_families(engines: Iterable[Figures]) -> List[Family]:
    waiting = Family("vllm:num_requests_waiting", "gauge",
                     "Number of requests waiting to be processed.")
    running = Family("vllm:num_requests_running", "gauge",
                     "Number of requests in model execution batches.")
    ttft = Family("vllm:time_to_first_token_seconds", "histogram",
                  "Histogram of time to first token in seconds.")
    e2e = Family("vllm:e2e_request_latency_seconds", "histogram",
                 "Histogram of e2e request latency in seconds.")
    queue = Family("vllm:request_queue_time_seconds", "histogram",
                   "Histogram of time spent in WAITING phase for request.")
    prompt = Family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.")
    generation = Family("vllm:generation_tokens_total", "counter",
                        "Number of generation tokens processed.")
    for f in engines:
        labels = {"model_name": f.name}
        waiting.add(labels, f.waiting)
        running.add(labels, f.running)
        ttft.add_histogram(labels, f.ttft, TTFT_BUCKETS_S, f.ttft_sum_ns / 1e9)
        e2e.add_histogram(labels, f.e2e, REQUEST_BUCKETS_S, f.e2e_sum_ns / 1e9)
        queue.add_histogram(labels, f.queue, REQUEST_BUCKETS_S, f.queue_sum_ns / 1e9)
        if f.prompt_tokens:
            prompt.add(labels, f.stats["tokens_total"])
        if f.iterative:  # a chunk is a token
            generation.add(labels, f.stats["chunks_total"])
    return [waiting, running, ttft, e2e, queue, prompt, generation]


def triton_families(engines: Iterable[Figures]) -> List[Family]:
    success = Family("nv_inference_request_success", "counter",
                     "Number of successful inference requests, all batch sizes")
    failure = Family("nv_inference_request_failure", "counter",
                     "Number of failed inference requests, all batch sizes")
    count = Family("nv_inference_count", "counter",
                   "Number of inferences performed (does not include cached requests)")
    execs = Family("nv_inference_exec_count", "counter",
                   "Number of model executions performed (does not include cached requests)")
    duration = Family("nv_inference_request_duration_us", "counter",
                      "Cumulative inference request duration in microseconds "
                      "(includes cached requests)")
    queue = Family("nv_inference_queue_duration_us", "counter",
                   "Cumulative inference queuing duration in microseconds "
                   "(includes cached requests)")
    compute = Family("nv_inference_compute_infer_duration_us", "counter",
                     "Cumulative compute inference duration in microseconds "
                     "(does not include cached requests)")
    pending = Family("nv_inference_pending_request_count", "gauge",
                     "Instantaneous number of pending requests awaiting execution per-model.")
    for f in engines:
        labels, s = {"model": f.name, "version": TRITON_VERSION}, f.stats
        success.add(labels, s["answered_total"])
        for reason, keys in FAILURE_REASONS:
            failure.add({**labels, "reason": reason}, sum(s[k] for k in keys))
        # requests given to the model: each records its wait as it is (one-shot: a
        # batch of n counts n; iterative: as it joins)
        count.add(labels, float(f.queue.sum()))
        execs.add(labels, s["batches_total"])  # iterative: each step is an execution
        duration.add(labels, f.e2e_sum_ns // 1000)
        queue.add(labels, f.queue_sum_ns // 1000)
        compute.add(labels, f.served_ns // 1000)
        pending.add(labels, f.waiting)
    return [success, failure, count, execs, duration, queue, compute, pending]


def render(segments: Sequence, kinds: Sequence[str], read_stats) -> str:
    """The compat families of these engines' segments, in the text format
    (read_stats: engine.serving.metrics', which this module's caller is)."""
    figures = [Figures(seg, read_stats(seg)) for seg in segments]
    families: List[Family] = []
    if "vllm" in kinds:
        families += vllm_families(figures)
    if "triton" in kinds:
        families += triton_families(figures)
    return "".join(f.text() for f in families if f.lines)


def serve_http(registry, segments: Callable[[], Sequence], kinds: Sequence[str], read_stats,
               port: int, host: str):
    """GET /metrics: the registry's families and then these kinds' of the
    engines segments() gives at each scrape (they change as models load and
    unload), always in
    the text format 0.0.4 (an OpenMetrics answer would add `_total` to
    Triton's counters); returns (server, thread)."""
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
    from socketserver import ThreadingMixIn

    from prometheus_client import generate_latest

    def app(environ, start_response):
        if environ.get("PATH_INFO") not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"expected GET /metrics\n"]
        body = generate_latest(registry) + render(segments(), kinds, read_stats).encode()
        start_response("200 OK", [("Content-Type", "text/plain; version=0.0.4; charset=utf-8"),
                                  ("Content-Length", str(len(body)))])
        return [body]

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args) -> None:  # a scrape is not news
            pass

    server = make_server(host, port, app, Server, handler_class=Quiet)
    thread = threading.Thread(target=server.serve_forever, name="shmbatch-metrics", daemon=True)
    thread.start()
    return server, thread
