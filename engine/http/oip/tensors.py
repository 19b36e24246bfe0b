"""Tensors of the Open Inference Protocol (KServe v2, as Triton serves it) as numpy arrays.

A tensor of a request or a response is a JSON object {"name", "datatype",
"shape", "data"}: its data in the JSON (row-major, flat or nested lists), or,
with the binary tensor data extension, as raw little-endian bytes after the
JSON. Then the HTTP header Inference-Header-Content-Length says where the
JSON ends, and each tensor's parameters.binary_data_size how many of the
bytes after it are its own, in the order the tensors are listed.

Everything here is a pure function of a body's bytes, and every size is
checked against the bytes that came before anything is allocated for it:
a declared size can refuse a body, never make one. A bad body is BadRequest,
whose message names what was expected and what came; matching the tensors
to an engine's is engine.http.oip.request's (read_inputs takes its check,
which sees every tensor's declared name, datatype and shape before any
tensor's data is converted). A tensor whose parameters name a system
shared-memory region (Triton's extension) is read here as that reference
alone (ShmRef, its size checked against the tensor's); the region itself is
engine.http.oip.sysshm's to read or write, in the worker that holds it.
"""
import json
import math
from typing import Callable, List, NamedTuple, Optional, Tuple

import numpy as np

from engine.http.errors import BadRequest
from engine.http.values import MAX_RANK, NUMPY, datatype_of, from_json, json_text

# datatypes of the protocol that no engine tensor can hold (numbers of a fixed size only)
UNHELD = ("BYTES", "BF16")
# the longest `timeout` a request may ask: a week, in microseconds
MAX_TIMEOUT_US = 7 * 24 * 3600 * 10**6
# a request's `id`, echoed in its answer (in each event of a stream): bounded, so
# that an answer never costs more than its own data
MAX_ID_CHARS = 256
# the parameters of Triton's shared-memory extension, on an input or a requested output
SHM_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
MAX_REGION_CHARS = 128  # a region's name (engine.http.oip.regions checks its characters)
MAX_SHM_BYTES = (1 << 63) - 1  # an offset or size past an int64 is no file's
# json.dumps with separators builds an encoder a call; one made once writes the same
_COMPACT = json.JSONEncoder(separators=(",", ":"))


class Tensor(NamedTuple):
    name: str
    datatype: str
    shape: Tuple[int, ...]
    array: Optional[np.ndarray]  # of that shape (a view of the body for binary data);
    region: Optional["ShmRef"] = None  # None, or where the data is instead of an array


class ShmRef(NamedTuple):
    """A tensor's bytes in a registered system shared-memory region."""
    region: str
    offset: int  # in the region
    byte_size: int


def shm_ref(params: dict, where: str) -> Optional[ShmRef]:
    """The shared-memory region a tensor's parameters name, or None when they
    name none; region and byte size come together, the offset is optional."""
    region = params.get("shared_memory_region")
    size = params.get("shared_memory_byte_size")
    offset = params.get("shared_memory_offset", 0)
    if region is None and size is None:
        if "shared_memory_offset" in params:
            raise BadRequest(f"{where}: expected shared_memory_region and "
                             f"shared_memory_byte_size with shared_memory_offset, got neither")
        return None
    if region is None or size is None:
        missing = "shared_memory_region" if region is None else "shared_memory_byte_size"
        raise BadRequest(f"{where}: expected shared_memory_region and shared_memory_byte_size "
                         f"together, got no {missing}")
    if not isinstance(region, str) or not 1 <= len(region) <= MAX_REGION_CHARS:
        raise BadRequest(f"{where}: shared_memory_region: expected a region's name of 1.."
                         f"{MAX_REGION_CHARS} characters, got {json_text(region)}")
    for key, value in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
        if type(value) is not int or not 0 <= value <= MAX_SHM_BYTES:
            raise BadRequest(f"{where}: {key}: expected a byte count >= 0, got "
                             f"{json_text(value)}")
    return ShmRef(region, offset, size)


def split(body: bytes, header_length: Optional[str]) -> Tuple[dict, memoryview]:
    """(the request's JSON object, the binary data after it) of a body whose
    JSON is its first header_length bytes (the whole body without the header)."""
    view = memoryview(body)
    if header_length is None:
        cut = len(body)
    else:
        try:
            cut = int(header_length)
        except ValueError:
            cut = -1
        if not 0 <= cut <= len(body):
            raise BadRequest(f"Inference-Header-Content-Length: expected a byte count in "
                             f"0..{len(body)} (the body's length), got {header_length!r}")
    where = "the body" if header_length is None else \
        f"the body's first {cut} bytes (Inference-Header-Content-Length)"
    try:  # a body without binary data is parsed as it came, uncopied
        request = json.loads(body if cut == len(body) else bytes(view[:cut]))
    except (UnicodeDecodeError, ValueError) as e:
        raise BadRequest(f"expected a JSON object in {where}, got malformed JSON ({e})") from None
    except RecursionError:
        raise BadRequest(f"expected a JSON object in {where}, got lists or objects nested "
                         f"deeper than the parser takes") from None
    if not isinstance(request, dict):
        raise BadRequest(f"expected a JSON object, got a JSON {type(request).__name__}")
    return request, view[cut:]


def parameters(obj: dict, where: str, known: Tuple[str, ...]) -> dict:
    """The known keys of obj's "parameters" (a JSON object), or {}. Other keys
    are ignored, as Triton and KServe do: the protocol's parameters are open
    (KServe's clients send content_type), and the caller checks the values."""
    params = obj.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise BadRequest(f"{where} parameters: expected a JSON object, got "
                         f"{type(params).__name__}")
    return {key: params[key] for key in known if key in params}


def request_id(obj: dict) -> Optional[str]:
    """The request's "id": absent, or a string of at most MAX_ID_CHARS, as the
    protocol's id is a string."""
    value = obj.get("id")
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_ID_CHARS:
        got = f"{len(value)} characters" if isinstance(value, str) else json_text(value)
        raise BadRequest(f"id: expected a string of at most {MAX_ID_CHARS} characters, got "
                         f"{got}")
    return value


def timeout_s(micros, default_s: float) -> float:
    """A request's `timeout` parameter (microseconds, as Triton's) in seconds:
    a number in 0..MAX_TIMEOUT_US (a week), 0 the server's default."""
    if type(micros) not in (int, float) or not 0 <= micros <= MAX_TIMEOUT_US:
        raise BadRequest(f"timeout: expected microseconds >= 0 and <= {MAX_TIMEOUT_US} (a "
                         f"week; 0: the server's default of {default_s:g} s), got "
                         f"{json_text(micros)}")
    return micros / 1e6 if micros else default_s


class Declared(NamedTuple):
    """An input tensor as the request declares it, before its data is read."""
    name: str
    datatype: str
    shape: Tuple[int, ...]


def read_inputs(request: dict, binary: memoryview,
                check: Optional[Callable[[List[Declared]], None]] = None) -> List[Tensor]:
    """The request's input tensors, their data read from the JSON or from
    `binary`, which they must use up exactly. check (BadRequest to refuse)
    sees every input's declared name, datatype and shape before any input's
    data is converted."""
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest(f"\"inputs\": expected a non-empty list of tensors, got "
                         f"{json_text(inputs)}")
    declared: List[Declared] = []
    sizes: list = []  # each input's binary_data_size, ShmRef, or None (its "data")
    for i, obj in enumerate(inputs):
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise BadRequest(f"inputs[{i}]: expected a tensor {{\"name\", \"datatype\", "
                             f"\"shape\", \"data\"}}, got {json_text(obj)}")
        name = obj["name"]
        declared.append(declare(obj, name))
        params = parameters(obj, f"input {name!r}", ("binary_data_size",) + SHM_PARAMETERS)
        size = params.get("binary_data_size")
        ref = shm_ref(params, f"input {name!r}")
        given = [what for what, there in (('"data"', "data" in obj),
                                          ("binary_data_size", size is not None),
                                          ("shared_memory_region", ref is not None)) if there]
        if len(given) != 1:
            raise BadRequest(f"input {name!r}: expected one of \"data\", a binary_data_size "
                             f"or a shared_memory_region parameter, got "
                             f"{' and '.join(given) or 'none'}")
        sizes.append(ref or size)
    if check is not None:
        check(declared)
    tensors, offset = [], 0
    for d, obj, size in zip(declared, inputs, sizes):
        name, datatype, shape = d
        if isinstance(size, ShmRef):
            tensors.append(Tensor(name, datatype, shape, None, shm_input(size, d)))
            continue
        if size is None:
            array = from_json(obj["data"], datatype, shape, name)
        else:
            array = _from_binary(binary, offset, size, datatype, shape, name)
            offset += size
        tensors.append(Tensor(name, datatype, shape, array))
    if offset != len(binary):
        raise BadRequest(f"the binary data after the JSON is {len(binary)} bytes, the inputs' "
                         f"binary_data_size parameters add up to {offset}")
    return tensors


def shm_input(ref: ShmRef, d: Declared) -> ShmRef:
    """ref, once its byte size is the declared input's bytes (BadRequest else)."""
    want = math.prod(d.shape) * NUMPY[d.datatype].itemsize
    if ref.byte_size != want:
        raise BadRequest(f"input {d.name!r}: shared_memory_byte_size: expected {want} bytes "
                         f"({d.datatype}{list(d.shape)}), got {ref.byte_size}")
    return ref


def declare(obj: dict, name: str) -> Declared:
    """An input as obj declares it ({"datatype", "shape"}: a JSON tensor's, or
    a protobuf tensor's fields): BadRequest for a datatype or shape no engine
    tensor takes. The gRPC front (engine.http.grpc) checks its tensors here too."""
    return Declared(name, _datatype(obj, name), _shape(obj, name))


def _datatype(obj: dict, name: str) -> str:
    datatype = obj.get("datatype")
    if datatype in NUMPY:
        return datatype
    if datatype in UNHELD:
        raise BadRequest(f"input {name!r}: datatype {datatype} is not served: an engine's "
                         f"tensors hold numbers ({', '.join(NUMPY)})")
    raise BadRequest(f"input {name!r}: expected a datatype of {', '.join(NUMPY)}, got "
                     f"{json_text(datatype)}")


def _shape(obj: dict, name: str) -> Tuple[int, ...]:
    shape = obj.get("shape")
    if not (isinstance(shape, list) and len(shape) <= MAX_RANK
            and all(type(d) is int and d >= 0 for d in shape)):
        raise BadRequest(f"input {name!r}: expected a shape (a list of at most {MAX_RANK} dims "
                         f">= 0), got {json_text(shape)}")
    return tuple(shape)


def _from_binary(binary: memoryview, offset: int, size, datatype: str, shape, name: str):
    dtype = NUMPY[datatype]
    want = math.prod(shape) * dtype.itemsize
    if type(size) is not int or size != want:
        raise BadRequest(f"input {name!r}: binary_data_size: expected {want} bytes ({datatype}"
                         f"{list(shape)}), got {json_text(size)}")
    if offset + size > len(binary):
        raise BadRequest(f"input {name!r}: binary_data_size {size} at byte {offset} of the "
                         f"binary data, which holds {len(binary)} bytes")
    return np.frombuffer(binary, dtype, math.prod(shape), offset).reshape(shape)


def response(model: str, request_id, outputs, version: str = "1") -> Tuple[bytes, Optional[int]]:
    """(body, JSON length or None) of an infer response: outputs are
    (name, array, how) in order, how True for binary data (after the JSON),
    False for JSON, or the parameters of a region it was written to (no data)."""
    tensors, buffers = [], []
    for name, array, binary in outputs:
        tensor = {"name": name, "datatype": datatype_of(array.dtype), "shape": list(array.shape)}
        if isinstance(binary, dict):
            tensor["parameters"] = binary
        elif binary:
            raw = np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes()
            tensor["parameters"] = {"binary_data_size": len(raw)}
            buffers.append(raw)
        else:
            tensor["data"] = array.ravel().tolist()
        tensors.append(tensor)
    header = {"model_name": model, "model_version": version, "outputs": tensors}
    if request_id is not None:
        header["id"] = request_id
    text = _COMPACT.encode(header).encode()
    if not buffers:
        return text, None
    return b"".join([text, *buffers]), len(text)






