"""An infer request of the Open Inference Protocol read against its engine.

Spec is one engine as a request is checked against it: its inputs'
protocol names, datatypes and shapes with their bounds, its outputs, its
queue_capacity and priority levels. It is plain data, so the parser process
(engine.http.server.parsing) can take it along with a body. parse_infer reads a
body against it: every input's declared name, datatype and shape are checked
before any input's data is converted, so a request that can never fit (more
requests than queue_capacity, a dim beyond its bound, a wrong rank or
datatype, an input or output named twice) costs no conversion.

Body limits. Unless http_max_body_bytes sets one for every model, a model's
limit is what an infer of queue_capacity requests can need, each input at
its bound:

- binary tensor data, exactly: queue_capacity x the inputs' bytes per
  request, after a JSON header (Inference-Header-Content-Length) within the
  JSON limit;
- JSON: JSON_BYTES_PER_VALUE (32) bytes of text per value (a float64's
  shortest repr and its comma take at most 26), at most MAX_JSON_BYTES
  (64 MiB: larger tensors travel as binary data), + HEADER_BYTES (64 KiB)
  for the rest (names, shapes, parameters, outputs, id).

The generate extension takes one request: its limit is that of one.
"""
import collections
import functools
import math
from typing import List, NamedTuple, Optional, Tuple, Union

import numpy as np

from engine.config import EngineConfig
from engine.http.body import HEADER_BYTES, MAX_JSON_BYTES
from engine.http.errors import BadRequest
from engine.http.oip import tensors
from engine.http.oip.tensors import Declared, ShmRef
from engine.http.values import datatype_of, from_json, json_text

JSON_BYTES_PER_VALUE = 32
PARAMETERS = ("timeout", "priority", "binary_data_output")


class Input(NamedTuple):
    name: str  # the protocol's: INPUT for a single-array engine
    datatype: str
    dims: Tuple[Optional[int], ...]  # a request's shape, None a variable dim
    bounds: Tuple[int, ...]  # each dim's most
    itemsize: int


class Spec(NamedTuple):
    name: str
    inputs: Tuple[Input, ...]
    outputs: Tuple[str, ...]
    capacity: int
    levels: int

    @property
    def values(self) -> int:
        """A request's values, every input at its bounds."""
        return sum(math.prod(i.bounds) for i in self.inputs)

    @property
    def row_bytes(self) -> int:
        """A request's bytes of binary tensor data, every input at its bounds."""
        return sum(math.prod(i.bounds) * i.itemsize for i in self.inputs)


class Parsed(NamedTuple):
    k: int  # requests: every input's first dim
    # [k, *shape] per input, in the engine's order; None for one in a region (`regions`)
    arrays: List[Optional[np.ndarray]]
    # (output index, name, how) of each output asked: how is binary (a bool), or the
    # shared-memory region it goes to
    wanted: List[Tuple[int, str, Union[bool, ShmRef]]]
    timeout_s: float
    priority: int  # the engine's level
    request_id: Optional[str]
    # (index in arrays, datatype, shape, region) of each input given in a region
    regions: Tuple[Tuple[int, str, Tuple[int, ...], ShmRef], ...] = ()

    @property
    def shared_memory(self) -> bool:
        """Whether an input or an output is in a shared-memory region."""
        return bool(self.regions) or any(isinstance(how, ShmRef) for _, _, how in self.wanted)


def spec_of(name: str, config: EngineConfig) -> Spec:
    """The engine's Spec (ValueError for a dtype the protocol has none for)."""
    inputs = tuple(Input(s.name or "INPUT", datatype_of(s.dtype), tuple(s.shape),
                         tuple(s.max_shape), np.dtype(s.dtype).itemsize)
                   for s in config.input_specs)
    outputs = tuple(s.name or "OUTPUT" for s in config.output_specs
                    if datatype_of(s.dtype))  # (each has one)
    return Spec(name, inputs, outputs, config.queue_capacity, config.priority_levels)


def body_limit(spec: Spec, header_length: Optional[str], rows: int,
               explicit: Optional[int]) -> Tuple[int, str]:
    """(the most bytes the body may have, what that limit is made of) for a
    request of at most `rows` requests (see the module's docstring)."""
    if explicit is not None:
        return explicit, "http_max_body_bytes"
    text = min(rows * spec.values * JSON_BYTES_PER_VALUE, MAX_JSON_BYTES)
    json_limit = text + HEADER_BYTES
    head = f"model {spec.name!r}: {rows} request(s)"
    try:
        cut = int(header_length) if header_length is not None else -1
    except ValueError:
        cut = -1
    if not 0 <= cut <= json_limit:
        capped = " (at most 64 MiB)" if text == MAX_JSON_BYTES else ""
        return json_limit, (f"{head} x {spec.values} values x {JSON_BYTES_PER_VALUE} B of JSON "
                            f"text{capped} + {HEADER_BYTES} B")
    return cut + rows * spec.row_bytes, (f"{head} x {spec.row_bytes} B of binary tensor data "
                                         f"after the {cut} B of JSON")


def parse_infer(body: bytes, header_length: Optional[str], spec: Spec,
                default_timeout_s: float) -> Parsed:
    """The infer request in body, read against spec; BadRequest for one
    the protocol or the engine does not take."""
    request, binary = tensors.split(body, header_length)
    plain = _plain(request, binary, spec, default_timeout_s)
    if plain is not None:
        return plain
    params = tensors.parameters(request, "request", PARAMETERS)
    timeout_s = tensors.timeout_s(params.get("timeout", 0), default_timeout_s)
    priority = engine_priority(spec, params.get("priority", 0))
    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise BadRequest(f"binary_data_output: expected true or false, got "
                         f"{json_text(binary_default)}")
    outputs = wanted(spec, request, binary_default)
    read = tensors.read_inputs(request, binary, functools.partial(check, spec))
    if len(read) == 1:  # the common case: one input (check made it the engine's)
        ordered = read
    else:
        given = {t.name: t for t in read}
        ordered = [given[i.name] for i in spec.inputs]
    regions = tuple((i, t.datatype, t.shape, t.region) for i, t in enumerate(ordered)
                    if t.region is not None)
    return Parsed(read[0].shape[0], [t.array for t in ordered], outputs, timeout_s, priority,
                  tensors.request_id(request), regions)


PLAIN_TENSOR = frozenset(("name", "datatype", "shape", "data"))


def _plain(request: dict, binary: memoryview, spec: Spec,
           default_timeout_s: float) -> Optional[Parsed]:
    """The common request read at less cost, as parse_infer reads it: one
    input of the engine's one, its data in the JSON, no parameters and no
    outputs asked. None for any other (parse_infer's general path reads it,
    and refuses what it must)."""
    if len(spec.inputs) != 1 or binary or "parameters" in request or "outputs" in request:
        return None
    inputs = request.get("inputs")
    if type(inputs) is not list or len(inputs) != 1:
        return None
    obj, want = inputs[0], spec.inputs[0]
    if type(obj) is not dict or obj.keys() != PLAIN_TENSOR or obj["name"] != want.name \
            or obj["datatype"] != want.datatype:
        return None
    shape = obj["shape"]
    if type(shape) is not list or len(shape) != len(want.dims) + 1:
        return None
    for d in shape:
        if type(d) is not int:
            return None
    k = shape[0]
    if not 1 <= k <= spec.capacity:
        return None
    for got, dim, bound in zip(shape[1:], want.dims, want.bounds):  # no generator: run per request
        if (got != dim) if dim is not None else not 1 <= got <= bound:
            return None
    shape = tuple(shape)
    array = from_json(obj["data"], want.datatype, shape, want.name)
    return Parsed(k, [array], wanted(spec, request, False), default_timeout_s, 0,
                  tensors.request_id(request))


def check(spec: Spec, declared: List[Declared]) -> None:
    """BadRequest unless the declared inputs are the engine's, each once, of
    its datatype and a shape within its bounds, all of as many requests (at
    least one, at most queue_capacity)."""
    names = [i.name for i in spec.inputs]
    got = [d.name for d in declared]
    _once("input", got)
    if sorted(got) != sorted(names):
        shown = got if len(got) <= 16 else got[:16] + ["..."]
        raise BadRequest(f"model {spec.name!r}: expected inputs {names}, got {shown}")
    by_name = {d.name: d for d in declared}
    k = None
    for i in spec.inputs:
        d = by_name[i.name]
        if d.datatype != i.datatype:
            raise BadRequest(f"input {i.name!r}: expected datatype {i.datatype}, got {d.datatype}")
        dims = zip(d.shape[1:], i.dims, i.bounds)
        if len(d.shape) != len(i.dims) + 1 or d.shape[0] < 1 or not all(
                got == want if want is not None else 1 <= got <= bound
                for got, want, bound in dims):
            bounds = ", ".join(f"1..{b}" if want is None else str(want)
                               for want, b in zip(i.dims, i.bounds))
            raise BadRequest(f"input {i.name!r}: expected shape [k{', ' if bounds else ''}"
                             f"{bounds}] (k >= 1 requests), got {list(d.shape)}")
        if k is not None and d.shape[0] != k:
            raise BadRequest(f"input {i.name!r}: expected {k} requests in its first dim, as "
                             f"input {names[0]!r} has, got {d.shape[0]}")
        k = d.shape[0]
    if k is None or k > spec.capacity:
        raise BadRequest(f"expected at most {spec.capacity} requests (the engine's "
                         f"queue_capacity) in one infer, got {k}")


def wanted(spec: Spec, request: dict,
           binary_default: bool) -> List[Tuple[int, str, Union[bool, ShmRef]]]:
    """(output index, protocol name, binary or the region it goes to) of each
    output asked for, each once."""
    asked = request.get("outputs")
    if asked is None:
        return [(i, name, binary_default) for i, name in enumerate(spec.outputs)]
    index = {name: i for i, name in enumerate(spec.outputs)}
    if not isinstance(asked, list):
        raise BadRequest(f"\"outputs\": expected a list of {{\"name\"}} objects, got "
                         f"{json_text(asked)}")
    out: List[Tuple[int, str, Union[bool, ShmRef]]] = []
    for obj in asked:
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or name not in index:
            raise BadRequest(f"model {spec.name!r}: expected outputs among "
                             f"{list(index)}, got {json_text(name or obj)}")
        params = tensors.parameters(obj, f"output {name!r}",
                                    ("binary_data",) + tensors.SHM_PARAMETERS)
        binary = params.get("binary_data", binary_default)
        if not isinstance(binary, bool):
            raise BadRequest(f"output {name!r}: binary_data: expected true or false, got "
                             f"{json_text(binary)}")
        ref = tensors.shm_ref(params, f"output {name!r}")
        out.append((index[name], name, binary if ref is None else ref))
    _once("output", [name for _, name, _ in out])
    return out


def _once(what: str, names: List[str]) -> None:
    """BadRequest naming the first name given more than once."""
    if len(set(names)) == len(names):  # the common case, without a Counter
        return
    counts = collections.Counter(names)
    twice = [n for n in names if counts[n] > 1]
    if twice:
        raise BadRequest(f"{what}s: expected each {what} named once, got {twice[0]!r} "
                         f"{counts[twice[0]]} times")


def engine_priority(spec: Spec, triton_priority) -> int:
    """The engine's level of a request's `priority` parameter (Triton's: 1
    the most urgent, 0 the default)."""
    levels = spec.levels
    if type(triton_priority) is not int or not 0 <= triton_priority <= levels:
        raise BadRequest(f"priority: expected 0 (the default) or 1..{levels} (1 the most "
                         f"urgent: model {spec.name!r} has {levels} level(s)), got "
                         f"{json_text(triton_priority)}")
    return max(0, triton_priority - 1)
