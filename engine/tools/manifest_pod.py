"""What a pod needs to run `shmbatch serve` from a serve config: the numbers
shmbatch knows and a hand-written manifest gets wrong.

- /dev/shm: a memory-backed emptyDir whose sizeLimit (the tmpfs's size) holds
  every engine's segment, the bytes Segment.create commits and
  stats()["segment_bytes"] reports, computed here without making one, plus a
  headroom for the pod's other users of /dev/shm, plus the 1/16 that
  engine.shm.sizing keeps free (an engine refuses to start without it).
- memory: a memory-backed emptyDir's pages count against the memory of the
  container that writes them, the serve container here (it commits each
  segment); its request and limit are the whole emptyDir plus the processes'
  own (supervisor, batchers, HTTP workers): measured (Measured, from
  engine.tools.manifest_measure: request = measured + a margin, limit =
  measured x a factor), or a budget per batcher and per other process
  (request = limit), whose default is a guess.
- readiness: true only while every engine serves (`/v2/health/ready`, or
  `shmbatch status NAME --ready` for each engine when there is no HTTP port).
- the API key (--api-key-secret NAME): SHMBATCH_API_KEY from the Secret's
  `api-key`, so the key is in neither the pod's spec nor the ConfigMap.
- stopping: a preStop sleep, then the kubelet's SIGTERM makes serve drain;
  terminationGracePeriodSeconds covers the sleep, the longest stop serve can
  take, and a margin.
"""
import dataclasses
import math
import re
import shlex
import textwrap
from typing import List, Optional, Tuple

from engine.serving import metrics_compat
from engine.shm import codes, ring
from engine.shm.sizing import SHM_MARGIN_DIVISOR, SHM_MARGIN_MIN_BYTES

MIB = 1 << 20
CONFIG_DIR = "/etc/shmbatch"
CONFIG_KEY = "models.toml"
SHM_VOLUME, CONFIG_VOLUME = "dshm", "config"
SERVE_CONTAINER = "shmbatch"
DEFAULT_METRICS_PORT = 9090
DEFAULT_HEADROOM_MIB = 64  # the app's own /dev/shm (multiprocessing, torch's DataLoader)
DEFAULT_PROCESS_MIB = 256  # one process with numpy and a small model; a big model needs more
DEFAULT_MARGIN_MIB = 64  # --measure: the request over what was measured
DEFAULT_LIMIT_FACTOR = 1.5  # --measure: the limit, x what was measured (processes grow serving)
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?\Z", re.I)
_UNITS = {"": 1, "k": 1000, "m": 1000 ** 2, "g": 1000 ** 3, "t": 1000 ** 4,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
DEFAULT_RUN_AS_USER = 1000
PRESTOP_SLEEP_S = 5  # the endpoints controller takes the pod out of the Service meanwhile
GRACE_MARGIN_S = 10
API_KEY_KEY = "api-key"  # the key of --api-key-secret's Secret that holds serve's API key
HTTP_KILL_AFTER_S = 10  # engine.http.server.workers kills a worker still running graceful_s + 10 s after SIGTERM
START_MARGIN_S = 10  # Engine.start waits start_timeout_s x instances + 10 s
READY_PERIOD_S, STARTUP_PERIOD_S = 5, 2
NOTE_WIDTH = 96  # the memory note's lines, as YAML comments
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?\Z")


def segment_bytes(cfg) -> int:
    """The bytes an engine's segment commits in /dev/shm (as Segment.create lays
    it out), or ValueError for one that cannot be made."""
    size = ring.layout_bytes(cfg.queue_capacity, len(cfg.slot_input_specs), cfg.slot_bytes,
                             cfg.in_place, cfg.priority_levels, cfg.steps)
    if size == 0:
        raise ValueError(f"engine {cfg.name!r}: a segment of {cfg.queue_capacity} slots of "
                         f"{cfg.input_slot_bytes} B input cannot be laid out: lower "
                         f"queue_capacity or the max shapes")
    if len(cfg.to_json()) > codes.CONFIG_BYTES:
        raise ValueError(f"engine {cfg.name!r}'s settings take {len(cfg.to_json())} B as JSON, "
                         f"more than the header's {codes.CONFIG_BYTES} B")
    return size


def shm_limit_bytes(segments: int, headroom: int) -> int:
    """The smallest tmpfs, in whole MiB, that holds the segments and the
    headroom and still has the 1/16 free that each engine checks for
    (engine.shm.sizing: T - used - max(1 MiB, T/16) >= 0)."""
    used = segments + headroom
    need = used * SHM_MARGIN_DIVISOR // (SHM_MARGIN_DIVISOR - 1) + SHM_MARGIN_MIN_BYTES
    return -(-need // MIB) * MIB


def dns_name(text: str) -> str:
    """A Kubernetes name (a DNS-1035 label, room left for suffixes) from an
    engine's or a file's name."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    name = re.sub(r"^[^a-z]+", "", name)[:40].rstrip("-")
    if not DNS_LABEL.match(name):
        raise ValueError(f"cannot make a Kubernetes name of {text!r}: give --name")
    return name


def _engines(settings: List[dict]):
    """(EngineConfig, EngineOptions) of each engine, checked as serve checks
    them (nothing imported, nothing created)."""
    from engine.serving.supervisor import Engine
    out = []
    for one in settings:
        one = dict(one)
        name = one.pop("name")
        try:
            eng = Engine(name, **one)
        except (TypeError, ValueError) as e:
            raise ValueError(f"engine {name!r}: {e}") from None
        out.append((eng.config, eng.options))
    return out


def size_bytes(text: str, what: str) -> int:
    """A memory size as a flag gives it: bytes, or a Kubernetes quantity
    (2Gi, 1500Mi, 1.5G); ValueError naming the flag otherwise."""
    found = _SIZE.match(str(text).strip())
    if not found:
        raise ValueError(f"{what}: expected a size like 2Gi, 1500Mi or 2G, got {text!r}")
    size = math.ceil(float(found[1]) * _UNITS[(found[2] or "").lower()])
    if size < MIB:
        raise ValueError(f"{what}: expected at least 1Mi, got {text!r}")
    return size


def mib(size: int) -> int:
    """Bytes as whole MiB, rounded up: a quantity never under what it stands for."""
    return -(-size // MIB)


@dataclasses.dataclass(frozen=True)
class Measured:
    """The memory a measuring run (engine.tools.manifest_measure) saw: each
    process's (its role, bytes outside /dev/shm: PSS + swap, the most seen),
    their RSS summed (shared pages counted in each: for comparison), the
    requests that ran, and how the pod is sized from it."""

    processes: Tuple[Tuple[str, int], ...]
    rss_bytes: int
    requests: int
    margin_bytes: int = DEFAULT_MARGIN_MIB * MIB
    limit_factor: float = DEFAULT_LIMIT_FACTOR

    @property
    def total_mib(self) -> int:
        """The processes' sum in whole MiB (rounded up), which the sizes add to."""
        return mib(sum(size for _, size in self.processes))

    def note(self) -> str:
        each = ", ".join(f"{role} {mib(size)} MiB" for role, size in self.processes)
        return (f"measured by --measure (serve started here with warmup; {self.requests} "
                f"requests of the config's largest shapes): each process's PSS + swap outside "
                f"/dev/shm, the most seen (PSS splits a shared page among the processes that "
                f"map it: the sum counts it once, as the cgroup does; /dev/shm's pages are the "
                f"emptyDir's): {each}; {self.total_mib} MiB in all (their RSS, which counts "
                f"a shared page in each process: {mib(self.rss_bytes)} MiB)")


@dataclasses.dataclass
class ServePod:
    """The serve container of a pod, and the numbers it is sized by."""

    name: str
    image: str
    engines: list  # (EngineConfig, EngineOptions)
    http_port: Optional[int]
    http_workers: int
    metrics_port: int
    headroom_bytes: int
    process_bytes: int
    api_key_secret: Optional[str] = None  # a Secret whose API_KEY_KEY is serve's API key
    batcher_bytes: Optional[int] = None  # --memory-per-batcher; None: process_bytes
    measured: Optional[Measured] = None  # sizes the memory instead of the budgets
    metrics_compat: Tuple[str, ...] = ()  # serve's --metrics-compat kinds (vllm, triton)
    grpc_port: Optional[int] = None  # serve's --grpc-port (in the HTTP workers)

    @property
    def names(self) -> List[str]:
        return [cfg.name for cfg, _ in self.engines]

    @property
    def segments(self) -> dict:
        return {cfg.name: segment_bytes(cfg) for cfg, _ in self.engines}

    @property
    def shm_bytes(self) -> int:
        return shm_limit_bytes(sum(self.segments.values()), self.headroom_bytes)

    @property
    def batchers(self) -> int:
        return sum(cfg.instances for cfg, _ in self.engines)

    @property
    def processes(self) -> int:
        return 1 + self.batchers + (self.http_workers if self.http_port is not None else 0)

    @property
    def memory_request_bytes(self) -> int:
        # in whole MiB, each term rounded up: the note's sums add up
        if self.measured is not None:
            m = self.measured
            return (mib(self.shm_bytes) + m.total_mib + mib(m.margin_bytes)) * MIB
        batcher = mib(self.process_bytes if self.batcher_bytes is None else self.batcher_bytes)
        others = self.processes - self.batchers
        return (mib(self.shm_bytes) + self.batchers * batcher
                + others * mib(self.process_bytes)) * MIB

    @property
    def memory_limit_bytes(self) -> int:
        if self.measured is None:  # request = limit: the pod is the last evicted
            return self.memory_request_bytes
        factored = math.ceil(self.measured.total_mib * self.measured.limit_factor)
        return max((mib(self.shm_bytes) + factored) * MIB, self.memory_request_bytes)

    @property
    def stop_bound_s(self) -> float:
        """The longest serve's stop takes: the HTTP workers' graceful shutdown
        (killed past drain_timeout_s + 10 s), then every engine's drain at once."""
        drain = max(opts.drain_timeout_s for _, opts in self.engines)
        http = math.ceil(drain) + HTTP_KILL_AFTER_S if self.http_port is not None else 0
        return drain + http

    @property
    def grace_s(self) -> int:
        return PRESTOP_SLEEP_S + math.ceil(self.stop_bound_s) + GRACE_MARGIN_S

    @property
    def start_bound_s(self) -> float:
        """The longest serve's start takes: the engines start one after another."""
        return sum(opts.start_timeout_s * cfg.instances + START_MARGIN_S
                   for cfg, opts in self.engines)

    @property
    def gpus(self) -> int:
        ids = {tok.strip() for _, opts in self.engines for g in (opts.gpus or [])
               for tok in str(g).split(",") if tok.strip()}
        return len(ids)

    def check(self) -> dict:
        """The handler of the readiness (and startup) probe."""
        # the HTTP route, where there is one: it is what the Service's traffic reaches
        # (ready also means the HTTP workers attached), it covers every engine, and a
        # GET starts no Python process in the container at every period, as exec does
        if self.http_port is not None:
            return {"httpGet": {"path": "/v2/health/ready", "port": self.http_port}}
        commands = [["shmbatch", "status", name, "--ready"] for name in self.names]
        if len(commands) == 1:
            return {"exec": {"command": commands[0]}}
        return {"exec": {"command": ["sh", "-c", " && ".join(shlex.join(c) for c in commands)]}}

    def probe(self, period_s: int, failures: int) -> dict:
        timeout_s = 2 if self.http_port is not None else 3 * len(self.names)
        return {**self.check(), "periodSeconds": period_s, "timeoutSeconds": timeout_s,
                "failureThreshold": failures}

    def args(self) -> List[str]:
        args = ["serve", "--config", f"{CONFIG_DIR}/{CONFIG_KEY}",
                "--metrics-port", str(self.metrics_port), "--metrics-host", "0.0.0.0"]
        if self.metrics_compat:
            args += ["--metrics-compat", ",".join(self.metrics_compat)]
        if self.http_port is not None:
            args += ["--http-port", str(self.http_port), "--http-host", "0.0.0.0"]
        if self.grpc_port is not None:
            args += ["--grpc-port", str(self.grpc_port), "--grpc-host", "0.0.0.0"]
        return args

    def container(self, name: str = SERVE_CONTAINER, startup: bool = False) -> dict:
        limits = {"memory": f"{mib(self.memory_limit_bytes)}Mi"}
        if self.gpus:
            limits["nvidia.com/gpu"] = self.gpus
        ports = [{"name": "metrics", "containerPort": self.metrics_port, "protocol": "TCP"}]
        if self.http_port is not None:
            ports.insert(0, {"name": "http", "containerPort": self.http_port, "protocol": "TCP"})
        if self.grpc_port is not None:
            ports.insert(1, {"name": "grpc", "containerPort": self.grpc_port, "protocol": "TCP"})
        out = {
            "name": name, "image": self.image, "command": ["shmbatch"], "args": self.args(),
            "ports": ports,
            # the cpu request: a core per batcher and HTTP worker; no cpu limit, whose
            # throttling would stall a batch halfway
            "resources": {"requests": {"cpu": str(self.processes - 1),
                                       "memory": f"{mib(self.memory_request_bytes)}Mi"},
                          "limits": limits},
            "readinessProbe": self.probe(READY_PERIOD_S, 2),
            "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
            "volumeMounts": [{"name": SHM_VOLUME, "mountPath": "/dev/shm"},
                             {"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True}],
        }
        if self.api_key_secret is not None:  # from the Secret: never in the pod's spec
            out["env"] = [{"name": "SHMBATCH_API_KEY", "valueFrom": {"secretKeyRef": {
                "name": self.api_key_secret, "key": API_KEY_KEY}}}]
        if startup:
            out["startupProbe"] = self.probe(
                STARTUP_PERIOD_S, math.ceil((self.start_bound_s + START_MARGIN_S) / STARTUP_PERIOD_S))
        return out

    def volumes(self) -> list:
        return [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory",
                                                  "sizeLimit": f"{self.shm_bytes // MIB}Mi"}},
                {"name": CONFIG_VOLUME, "configMap": {"name": self.config_map_name}}]

    @property
    def labels(self) -> dict:
        return {"app.kubernetes.io/name": self.name, "app.kubernetes.io/component": "shmbatch"}

    @property
    def config_map_name(self) -> str:
        return f"{self.name}-config"

    def config_map(self, text: str, namespace: Optional[str]) -> dict:
        return {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": metadata(self.config_map_name, self.labels, namespace),
                "data": {CONFIG_KEY: text}}

    def sizing_note(self) -> str:
        """The sizes, and where they come from, as a comment for the manifest."""
        each = ", ".join(f"{n} {b:,} B" for n, b in self.segments.items())
        shm = mib(self.shm_bytes)
        return (f"/dev/shm {shm} MiB: the segments ({each}),\n"
                f"+ {self.headroom_bytes // MIB} MiB headroom, + the 1/{SHM_MARGIN_DIVISOR} an "
                f"engine keeps free.\n" + "\n".join(
                    textwrap.fill(part, NOTE_WIDTH, break_on_hyphens=False)
                    for part in self._memory_note(shm)))

    def _memory_note(self, shm: int) -> List[str]:
        """Its paragraphs: where the memory's figures come from, and its sums."""
        request, limit = mib(self.memory_request_bytes), mib(self.memory_limit_bytes)
        head = ("memory: that emptyDir (its pages count against the serve container) + its "
                "processes', ")
        m = self.measured
        if m is not None:
            factored = shm + math.ceil(m.total_mib * m.limit_factor)
            at_least = f" ({factored} MiB, raised to the request)" if factored < request else ""
            return [f"{head}{m.note()}.",
                    f"request {request} MiB = {shm} + {m.total_mib} + a margin of "
                    f"{mib(m.margin_bytes)}; limit {limit} MiB = {shm} + {m.total_mib} x "
                    f"{m.limit_factor:g}{at_least}."]
        others = self.processes - self.batchers
        if self.batcher_bytes is not None:
            return [f"{head}{request} MiB = {shm} + {self.batchers} batcher(s) x "
                    f"{mib(self.batcher_bytes)} (--memory-per-batcher) + {others} other "
                    f"process(es) (serve, HTTP workers) x {mib(self.process_bytes)}."]
        return [f"{head}{request} MiB = {shm} + {self.processes} processes x "
                f"{mib(self.process_bytes)}.",
                f"The {mib(self.process_bytes)} MiB a process is a GUESS, a numpy model's: a "
                f"torch model's batcher takes far more. Measure it with `shmbatch manifest ... "
                f"--measure` where the model runs, or give --memory-per-batcher SIZE."]


def or_default(value, default):
    return default if value is None else value


def metadata(name: str, labels: dict, namespace: Optional[str]) -> dict:
    out = {"name": name, "labels": dict(labels)}
    if namespace:
        out["namespace"] = namespace
    return out


def serve_pod(engines: List[dict], serve: dict, *, name: Optional[str], image: str,
              metrics_port: Optional[int], headroom_mib: int, process_mib: int,
              http_port: Optional[int] = None, fallback_name: str = "shmbatch",
              api_key_secret: Optional[str] = None,
              batcher_bytes: Optional[int] = None) -> ServePod:
    """The serve container's plan, from serve_plan's (engines, serve's own
    keys): http_port, when given, stands in for the config's."""
    built = _engines(engines)
    if name is None:
        name = dns_name(built[0][0].name if len(built) == 1 else fallback_name)
    elif not DNS_LABEL.match(name):
        raise ValueError(f"--name: expected a DNS label of at most 40 characters "
                         f"([a-z][-a-z0-9]*), got {name!r}")
    http = http_port if http_port is not None else serve.get("http_port")
    metrics = metrics_port or serve.get("metrics_port") or DEFAULT_METRICS_PORT
    grpc = serve.get("grpc_port")
    ports = (("http_port", http), ("metrics_port", metrics), ("grpc_port", grpc))
    for what, port in ports:
        if port is not None and not 0 < int(port) < 65536:  # 0 (any free port) has no Service
            raise ValueError(f"{what}: expected a port in 1..65535 for a pod, got {port}")
    for i, (what, port) in enumerate(ports):
        for other, taken in ports[:i]:
            if port is not None and taken is not None and int(port) == int(taken):
                raise ValueError(f"{other} and {what} are both {port}: expected each its own "
                                 f"port")
    if grpc is not None and http is None:
        raise ValueError("grpc_port: gRPC is served by the HTTP workers: expected http_port "
                         "in the config (or --http-port), got none")
    if headroom_mib < 0 or process_mib < 1:
        raise ValueError(f"expected --shm-headroom-mib >= 0 and --process-memory-mib >= 1, "
                         f"got {headroom_mib} and {process_mib}")
    pod = ServePod(name=name, image=image, engines=built,
                   http_port=None if http is None else int(http),
                   http_workers=int(serve.get("http_workers") or 1), metrics_port=int(metrics),
                   headroom_bytes=headroom_mib * MIB, process_bytes=process_mib * MIB,
                   api_key_secret=api_key_secret, batcher_bytes=batcher_bytes,
                   metrics_compat=metrics_compat.parse(serve.get("metrics_compat")),
                   grpc_port=None if grpc is None else int(grpc))
    if api_key_secret is not None and pod.http_port is None:
        raise ValueError("--api-key-secret: the API key guards the HTTP port: expected "
                         "http_port in the config, got none")
    for cfg, _ in built:  # every engine sized now: one that cannot be fails here
        segment_bytes(cfg)
    return pod
