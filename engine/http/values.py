"""JSON values as an engine's arrays, and as a refusal's message shows them.

Both protocols take tensors as JSON values: the Open Inference Protocol's
tensors and generate requests (engine.http.oip), the OpenAI API's fields
that feed an engine's inputs (engine.http.openai). A value is converted
only once its type, shape and range are checked against the datatype,
with work bounded by the shape, never by the value's size; json_text()
shows what came, cut short, at a cost bounded the same way; json_object()
reads a body that must be a JSON object.
"""
import itertools
import json
import math

from typing import Dict, Set, Tuple

import numpy as np

from engine.http.errors import BadRequest

# numpy dtype name -> the protocol's datatype, each way
DATATYPES = {"bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32",
             "uint64": "UINT64", "int8": "INT8", "int16": "INT16", "int32": "INT32",
             "int64": "INT64", "float16": "FP16", "float32": "FP32", "float64": "FP64"}
NUMPY = {datatype: np.dtype(name).newbyteorder("<") for name, datatype in DATATYPES.items()}


def _range(dtype: np.dtype) -> tuple:
    info = np.iinfo(dtype) if dtype.kind in "iu" else np.finfo(dtype)
    return info.min, info.max


# each numeric datatype's (min, max), read once: np.finfo and np.iinfo cost ~1 µs a call
_RANGES = {datatype: _range(d) for datatype, d in NUMPY.items() if d.kind != "b"}
_OF_DTYPE = {np.dtype(name): datatype for name, datatype in DATATYPES.items()}  # per request
MAX_RANK = 32  # lists nested deeper are no tensor's (numpy's own bound is 64)

# the JSON values each kind of datatype takes: booleans for BOOL, integers for
# the integer types, any number for the floating ones
_JSON_TYPES: Dict[str, Tuple[Set[type], str]] = {"b": ({bool}, "booleans"), "u": ({int}, "integers"), "i": ({int}, "integers"),
               "f": ({int, float}, "numbers")}



def datatype_of(dtype) -> str:
    """The protocol's datatype of a numpy dtype; ValueError for one it has none for."""
    found = _OF_DTYPE.get(dtype) if isinstance(dtype, np.dtype) else None
    if found is not None:
        return found
    name = np.dtype(dtype).name
    if name not in DATATYPES:
        raise ValueError(f"the Open Inference Protocol has no datatype for {name} (it has "
                         f"{', '.join(DATATYPES)})")
    return DATATYPES[name]



def value_array(value, datatype: str, name: str) -> np.ndarray:
    """A tensor given as a bare JSON value (a number, or nested lists of the
    tensor's shape) as an array of datatype."""
    shape: list = []
    inner = value
    while isinstance(inner, list):
        if len(shape) == MAX_RANK:
            raise BadRequest(f"input {name!r}: expected a value or lists nested at most "
                             f"{MAX_RANK} deep, got deeper ones")
        shape.append(len(inner))
        if not inner:
            break
        inner = inner[0]
    return from_json(value if shape else [value], datatype, tuple(shape), name)



def from_json(data, datatype: str, shape, name: str) -> np.ndarray:
    dtype, count = NUMPY[datatype], math.prod(shape)
    types, what = _JSON_TYPES[dtype.kind]
    values = _flat(data, shape)
    if values is None:
        raise BadRequest(f"input {name!r}: expected {count} {what} ({datatype}{list(shape)}) as "
                         f"a flat list or as lists nested as its shape, got {json_text(data)}")
    # the types are checked on the JSON's own values: numpy would read 2**64 - 1
    # beside 0 as a float, and "1" or 1.5 as integers
    found = set(map(type, values))
    if not found <= types or len(values) != count:
        got = (f"{len(values)} {_JSON_TYPES['f' if found <= {int, float} else 'b'][1]}"
               if found <= {int, float} or found == {bool} else json_text(data))
        raise BadRequest(f"input {name!r}: expected {count} {what} ({datatype}{list(shape)}), "
                         f"got {got}")
    if dtype.kind != "b" and values:
        least, most = _RANGES[datatype]
        low, high = min(values), max(values)
        if low < least or high > most:
            raise BadRequest(f"input {name!r}: expected {datatype} values in {least}.."
                             f"{most}, got {low}..{high}")
    return np.array(values, dtype).reshape(shape)



def _flat(data, shape):
    """The values of data in row-major order: data itself when it is a flat
    list, or lists nested exactly as the shape, flattened; None if it is
    neither. The work is bounded by the shape, never by data's size."""
    if type(data) is not list:
        return None
    if list not in set(map(type, data)):
        return data  # flat, as the protocol writes it
    values, count = data, 1
    for depth, dim in enumerate(shape):
        count *= dim
        if len(values) != count:
            return None
        if depth == len(shape) - 1:
            break
        # each a list, and all of them as long as the next dim
        if set(map(type, values)) != {list} or \
                sum(map(len, values)) != count * shape[depth + 1]:
            return None
        values = list(itertools.chain.from_iterable(values))
    else:
        return None  # nested lists, for a scalar
    return values if list not in set(map(type, values)) else None



def json_text(value, limit: int = 60) -> str:
    """A value as the message shows it: JSON, cut short. Only what shows is
    written out, so a large or deeply nested value costs no more than a small one."""
    parts, size, todo = [], 0, [value]  # todo: values and _Text to write, the next last
    while todo and size <= limit:
        v = todo.pop()
        piece: str
        if isinstance(v, _Text):
            piece = v
        elif isinstance(v, (list, dict)):
            items = list(itertools.islice(v.items() if isinstance(v, dict) else v, limit))
            todo.append(_Text("}" if isinstance(v, dict) else "]"))
            for i in reversed(range(len(items))):
                if isinstance(v, dict):
                    todo += [items[i][1], _Text(_dumps(str(items[i][0])) + ": ")]
                else:
                    todo.append(items[i])
                if i:
                    todo.append(_Text(", "))
            piece = "{" if isinstance(v, dict) else "["
        else:
            piece = _dumps(v)
        parts.append(piece)
        size += len(piece)
    text = "".join(parts)
    return text if not todo and len(text) <= limit else text[:limit - 3] + "..."



class _Text(str):
    """What json_text writes as it is (punctuation), beside the values it writes as JSON."""



def _dumps(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def json_object(raw: bytes, what: str = "a JSON object") -> dict:
    """The JSON object raw holds; BadRequest naming `what` was expected and
    what came (malformed JSON, or another JSON value)."""
    try:
        found = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"expected {what}, got malformed JSON ({e})") from None
    if not isinstance(found, dict):
        raise BadRequest(f"expected {what}, got {json_text(found)}")
    return found
