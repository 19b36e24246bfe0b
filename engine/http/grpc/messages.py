"""ModelInferRequest and ModelInferResponse (Triton's grpc_service.proto) as an engine's arrays.

A request is read against its engine's Spec by the HTTP front's own rules
(engine.http.oip.request and engine.http.oip.tensors), with their error
texts: each input's declared datatype and shape (tensors.declare), then all
of them against the engine (request.check: names, datatypes, shapes within
bounds, at most queue_capacity requests), before any input's data is
converted; `timeout` (microseconds) and `priority` (1 the most urgent) as
infer's parameters; `id` bounded as infer's. Other parameters are ignored,
as Triton and KServe do.

An input's data is either in raw_input_contents (one little-endian buffer
per input, in the inputs' order: every input's or none, as the protocol
says) or in its typed `contents`, the field of its datatype (FP16 has none:
raw only, as Triton), or, named by its shared_memory_region,
shared_memory_byte_size and shared_memory_offset parameters, in a registered
system shared-memory region (then raw_input_contents holds the other
inputs' buffers, as Triton's clients send them). Each size is checked
against the shape before anything is allocated for it. Answers travel as
raw_output_contents, as Triton's do, but for an output whose parameters
name a region: it is written there, and its answer carries the region's
parameters and no data.

A message's size is bounded by the gRPC server's max_receive_message_length
(max_message_bytes): what an infer of queue_capacity requests of the largest
engine can need in typed contents, MAX_VALUE_BYTES a value (a varint's
most), + HEADER_BYTES, unless http_max_body_bytes sets one for all.
"""
import math
import time
from typing import Iterable, Optional, Tuple

import numpy as np

from engine.http.body import HEADER_BYTES
from engine.http.errors import BadRequest
from engine.http.grpc.generated import grpc_service_pb2 as pb
from engine.http.oip import request, tensors
from engine.http.oip.repository import VERSION
from engine.http.oip.request import Parsed, Spec
from engine.http.values import NUMPY, datatype_of

MAX_VALUE_BYTES = 10  # a protobuf varint's most; fixed-size values take 8 or fewer
MAX_MESSAGE_BYTES = 2**31 - 1  # what grpc's option (an int) can hold
# each datatype's field of InferTensorContents, and the wider type it travels as
TYPED = {"BOOL": ("bool_contents", np.bool_), "INT8": ("int_contents", np.int32),
         "INT16": ("int_contents", np.int32), "INT32": ("int_contents", np.int32),
         "INT64": ("int64_contents", np.int64), "UINT8": ("uint_contents", np.uint32),
         "UINT16": ("uint_contents", np.uint32), "UINT32": ("uint_contents", np.uint32),
         "UINT64": ("uint64_contents", np.uint64), "FP32": ("fp32_contents", np.float32),
         "FP64": ("fp64_contents", np.float64)}


def max_message_bytes(specs: Iterable[Spec], explicit: Optional[int]) -> int:
    """The largest request message the server reads (see the module's docstring)."""
    if explicit is not None:
        return min(explicit, MAX_MESSAGE_BYTES)
    most = max((s.capacity * s.values * MAX_VALUE_BYTES for s in specs), default=0)
    return min(most + HEADER_BYTES, MAX_MESSAGE_BYTES)


def parameters(params) -> dict:
    """A protobuf map of InferParameter as {key: its value} (None: unset)."""
    out = {}
    for key, value in params.items():
        kind = value.WhichOneof("parameter_choice")
        out[key] = None if kind is None else getattr(value, kind)
    return out


def read_infer(msg, spec: Spec, default_timeout_s: float) -> Tuple[Parsed, dict]:
    """(the infer request in msg, read against spec as the HTTP front reads
    one, and every request parameter as Python values); BadRequest for one
    the protocol or the engine does not take."""
    params = parameters(msg.parameters)
    timeout_s = tensors.timeout_s(params.get("timeout", 0), default_timeout_s)
    priority = request.engine_priority(spec, params.get("priority", 0))
    request_id = tensors.request_id({"id": msg.id}) if msg.id else None
    asked = [{"name": o.name, "parameters": parameters(o.parameters)} for o in msg.outputs]
    wanted = request.wanted(spec, {"outputs": asked} if asked else {}, True)
    inputs = msg.inputs
    if not inputs:
        raise BadRequest("inputs: expected a non-empty list of tensors, got none")
    declared = [tensors.declare({"datatype": t.datatype, "shape": list(t.shape)}, t.name)
                for t in inputs]
    refs = [tensors.shm_ref(parameters(t.parameters), f"input {d.name!r}")
            for t, d in zip(inputs, declared)]
    request.check(spec, declared)
    raw = msg.raw_input_contents
    held = sum(ref is None for ref in refs)  # inputs whose data the message holds
    if raw and len(raw) != held:
        beside = "" if held == len(inputs) else " not in a shared-memory region"
        raise BadRequest(f"raw_input_contents: expected one buffer per input{beside} "
                         f"({held}), got {len(raw)}")
    arrays: dict = {}
    regions = {}
    for tensor, d, ref in zip(inputs, declared, refs):
        if ref is not None or raw:
            if tensor.HasField("contents"):
                where = "raw_input_contents" if ref is None else "a shared-memory region"
                raise BadRequest(f"input {d.name!r}: expected its data in {where} or in "
                                 f"contents, got both")
        if ref is not None:
            arrays[d.name], regions[d.name] = None, (d, tensors.shm_input(ref, d))
        elif raw:
            i = len(arrays) - len(regions)  # its buffer: the inputs' before it, less regions'
            arrays[d.name] = _from_raw(raw[i], i, d)
        else:
            arrays[d.name] = _from_typed(tensor.contents, d)
    order = [i.name for i in spec.inputs]
    return Parsed(declared[0].shape[0], [arrays[name] for name in order], wanted, timeout_s,
                  priority, request_id, tuple((order.index(name), d.datatype, d.shape, ref)
                                              for name, (d, ref) in regions.items())), params


def _from_raw(buffer: bytes, i: int, d: tensors.Declared) -> np.ndarray:
    dtype = NUMPY[d.datatype]
    count = math.prod(d.shape)
    if len(buffer) != count * dtype.itemsize:
        raise BadRequest(f"input {d.name!r}: raw_input_contents[{i}]: expected "
                         f"{count * dtype.itemsize} bytes ({d.datatype}{list(d.shape)}), got "
                         f"{len(buffer)}")
    return np.frombuffer(buffer, dtype, count).reshape(d.shape)


def _from_typed(contents, d: tensors.Declared) -> np.ndarray:
    typed = TYPED.get(d.datatype)
    if typed is None:
        raise BadRequest(f"input {d.name!r}: expected {d.datatype} data in raw_input_contents "
                         f"(InferTensorContents has no field for it), got contents")
    field, wide = typed
    values = getattr(contents, field)
    count = math.prod(d.shape)
    if len(values) != count:
        raise BadRequest(f"input {d.name!r}: contents.{field}: expected {count} values "
                         f"({d.datatype}{list(d.shape)}), got {len(values)}")
    array: np.ndarray = np.array(values, wide)
    dtype = NUMPY[d.datatype]
    if dtype.itemsize < array.dtype.itemsize and array.size:  # INT8, INT16, UINT8, UINT16
        info = np.iinfo(dtype)
        low, high = int(array.min()), int(array.max())
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise BadRequest(f"input {d.name!r}: contents.{field}: expected values in "
                             f"{info.min}..{info.max} ({d.datatype}), got {bad}")
    return array.astype(dtype, copy=False).reshape(d.shape)


def response(model: str, request_id: Optional[str], outputs, params: Optional[dict] = None):
    """A ModelInferResponse of outputs, (name, array, how) each: how True, as
    raw_output_contents; how a dict, written to a shared-memory region
    already, its parameters and an empty buffer (engine.http.oip.sysshm: as
    Triton's, clients find an output's buffer by its position); params: the
    response's parameters ({key: bool, int or str})."""
    out = pb.ModelInferResponse(model_name=model, model_version=VERSION,
                                id=request_id or "")
    for name, array, how in outputs:
        tensor = out.outputs.add()
        tensor.name, tensor.datatype = name, datatype_of(array.dtype)
        tensor.shape.extend(array.shape)
        if isinstance(how, dict):  # an empty buffer keeps the others' positions
            _set(tensor.parameters, how)
            out.raw_output_contents.append(b"")
            continue
        out.raw_output_contents.append(
            np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes())
    _set(out.parameters, params or {})
    return out


def _set(into, params: dict) -> None:
    """params ({key: bool, int or str}) into a protobuf map of InferParameter."""
    for key, value in params.items():
        kind = ("bool_param" if isinstance(value, bool) else "int64_param"
                if isinstance(value, int) else "string_param")
        setattr(into[key], kind, value)


def deadline_s(timeout_s: float, arrived: float, context) -> float:
    """What is left now of a request's timeout, counted from its arrival
    (time.monotonic()), cut to its call's remaining time (grpc-timeout, which
    gRPC counts from now)."""
    left_s = timeout_s - (time.monotonic() - arrived)
    remaining: Optional[float] = context.time_remaining()
    if remaining is None or not math.isfinite(remaining):
        return left_s
    return min(left_s, remaining)
