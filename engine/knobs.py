"""What a knob of Engine(...) is: a dataclass field with its default, its
kind (how `shmbatch serve` parses its flag) and what it does; and each
knob's value checked against its kind before any is used: a wrong kind is
one ValueError naming the knob, what was expected and what came, alike for
Engine(...), a TOML table and a config posted to a running serve. Dtypes and
shapes have their own checks (engine.tensors); None is a knob's "unset" only
where its default is None."""
import dataclasses
import numbers


def knob(default, cli: str, doc: str):
    """A dataclass field that is one of Engine(...)'s knobs: its default, how
    `shmbatch serve` parses its flag (str, int, float, bool, ints, json,
    shape, cpus, gpus, key_values, callable), and what it does. Engine, the CLI's flags and the
    TOML keys are all read off these fields (EngineConfig, EngineOptions)."""
    return dataclasses.field(default=default, metadata={"cli": cli, "doc": doc})


EXPECTED = {"int": "an integer", "float": "a number", "bool": "true or false",
            "ints": "a list of integers"}


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _of_kind(kind: str, value) -> bool:
    if kind == "int":
        return _integer(value)
    if kind == "float":
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy's
    values = value.tolist() if hasattr(value, "tolist") else value  # "ints", the last kind
    return isinstance(values, (list, tuple)) and all(_integer(v) for v in values)


def check(config) -> None:
    """ValueError for the first knob of this dataclass whose value is not of its kind."""
    for field in dataclasses.fields(config):
        kind, value = field.metadata.get("cli"), getattr(config, field.name)
        if kind not in EXPECTED or (value is None and field.default is None):
            continue
        if not _of_kind(kind, value):
            raise ValueError(f"{field.name}: expected {EXPECTED[kind]}, got {value!r} "
                             f"({type(value).__name__})")
