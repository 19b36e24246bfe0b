"""How the `shmbatch` command reads its flags: values, shapes, and each of
Engine(...)'s knobs as a flag (read off the knob's own field)."""
import argparse
import json
import tomllib

# serve's own keys: its flags, and a --config file's top level beside an
# engine's keys or [engines.NAME] tables
SERVE_ONLY_KEYS = ("metrics_port", "metrics_host", "metrics_compat", "http_port", "http_host",
                   "grpc_port", "grpc_host", "http_workers", "http_timeout_s", "http_max_body_bytes", "http_read_timeout_s",
                   "http_max_connections", "api_key", "model_control")


class Parser(argparse.ArgumentParser):
    """Bad flags: one line on stderr, exit 2 (argparse would add its usage)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message}\n")


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
    """128,3 (or (128, 3), [128, 3]); none marks a variable dim; '' or () a scalar."""
    dims = [d.strip() for d in text.strip().strip("()[]").split(",")]
    try:
        return tuple(None if d.lower() == "none" else int(d) for d in dims if d)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shape like 128,3 ('' or () for a "
                                         f"scalar), got {text!r}") from None


def boolean(text: str) -> bool:
    value = toml_value(text.lower())
    if not isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def json_value(text: str):
    """A flag's JSON value (named tensors: {"ids": ["int64", [null]]})."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected JSON, got {text!r} ({e})") from None


def numbers(kind):
    def parse(text: str):
        try:
            return [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    return parse


def knobs():
    from engine.serving.supervisor import KNOBS  # Engine(...)'s keywords, each once
    return KNOBS


def knob_flag(p, knob, with_default: bool = False) -> None:
    """The flag of one of Engine(...)'s knobs, parsed as the knob says; serve
    takes no defaults (a --config file's keys may stand in for flags)."""
    kind, doc = knob.metadata["cli"], knob.metadata["doc"]
    default = knob.default if with_default else None
    if kind == "key_values":  # --backend-arg K=V, repeated
        p.add_argument("--backend-arg", action="append", metavar="KEY=VALUE", help=doc)
        return
    flag = "--" + knob.name.replace("_", "-")
    if kind == "cpus":
        p.add_argument(flag, action="append", type=cpu_list, metavar="0[,1...]",
                       help=f"{doc}; one flag per instance")
        return
    parse = {"int": int, "float": float, "shape": shape, "bool": boolean, "json": json_value,
             "ints": numbers(int)}.get(kind, str)
    metavar = {"callable": "MOD:FACTORY", "gpus": "0,1", "shape": "SHAPE", "json": "JSON",
               "ints": "N,N,..."}.get(kind)
    if kind == "shape":
        doc += " (e.g. 128,3; none a variable dim; '' a scalar)"
    elif kind == "json":
        doc += " (JSON; in a TOML file, a table)"
    if kind == "bool":  # --warmup alone means true; --warmup false still parses
        p.add_argument(flag, type=parse, default=default, nargs="?", const=True,
                       metavar="true|false", help=doc)
        return
    p.add_argument(flag, type=parse, default=default, metavar=metavar, help=doc)


def cpu_list(text: str):
    return numbers(int)(text)


def config_shape(value, key):
    """A shape as a config file gives it: a list, an int, or the --shape text."""
    if value is None or isinstance(value, (list, tuple)):
        return None if value is None else tuple(
            None if d is None or (isinstance(d, str) and d.lower() == "none") else int(d)
            for d in value)
    if isinstance(value, int):
        return (value,)
    return shape(str(value))


def metrics_flags(p) -> None:
    """serve's /metrics flags."""
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-host", help="address for /metrics (default 127.0.0.1; 0.0.0.0: "
                                          "every interface)")
    p.add_argument("--metrics-compat", metavar="vllm,triton",
                   help="/metrics also carries these servers' names for the same figures "
                        "(vllm:num_requests_waiting, nv_inference_request_success, ...), for "
                        "their dashboards and autoscaler recipes (default: none)")


def flag_of(key: str) -> str:
    return "--backend-arg" if key == "backend_args" else "--" + key.replace("_", "-")


def engine_settings(settings: dict, args, where) -> dict:
    """One engine's settings: its keys (a file's or a table's, at `where`),
    overridden by the flags in args (None: none)."""
    all_knobs = knobs()
    keys = [k.name for k in all_knobs]
    if where:
        unknown = sorted(set(settings) - set(keys))
        if unknown:  # a table holds an engine's keys alone; a one-engine file serve's too
            expected = keys if args is None else keys + list(SERVE_ONLY_KEYS)
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; "
                             f"expected some of {', '.join(expected)}")
    for key in keys if args is not None else ():
        value = getattr(args, key, None)
        if value is not None and key != "backend_args":
            settings[key] = value
    flags = key_values(args.backend_arg) if args is not None else {}
    settings["backend_args"] = {**settings.get("backend_args", {}), **flags}
    for knob in all_knobs:
        if knob.metadata["cli"] == "shape" and knob.name in settings:
            settings[knob.name] = config_shape(settings[knob.name], knob.name)
        if knob.metadata["cli"] == "gpus" and isinstance(settings.get(knob.name), str):
            settings[knob.name] = [g.strip() for g in settings[knob.name].split(",") if g.strip()]
    spec = ("inputs", "outputs") if "inputs" in settings else ("input_shape", "output_shape")
    spec = spec[:1] if settings.get("sampling") else spec  # a sampling engine's outputs: its own
    missing = [k for k in ("name", "backend", *spec) if k not in settings]
    if missing and args is None:
        raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
    if missing:
        raise ValueError("missing " + ", ".join(flag_of(k) for k in missing)
                         + " (or the key in --config)")
    return settings
