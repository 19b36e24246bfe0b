"""Triton's system shared-memory extension on the Open Inference Protocol's routes.

The routes, under /v2/systemsharedmemory: GET /status and
/region/NAME/status (Triton's [{name, key, offset, byte_size}]), POST
/region/NAME/register (a JSON body {key, offset, byte_size}), POST
/region/NAME/unregister and /unregister (every region); a success answers
200 with an empty body, as Triton's. The table and the safety of each
region's object are engine.http.oip.regions' and region_files'.

An infer's input whose parameters name a region is read from it instead of
the body, and an output that names one is written to it: its answer
carries the region's parameters and no data. Every size is checked before
a byte moves: an input's shared_memory_byte_size equals its tensor's bytes
(engine.http.oip.tensors), offset + byte size lies within the region, an
output's byte size holds the output (before the requests are enqueued when
the output's shape is fixed, and always before it is written). Every fault
is a 400 that says what was expected and what came.

Up to INLINE_BYTES of a request's regions are read or written on the event
loop (a 1 MiB pread takes tens of microseconds); more in a thread, on
descriptors of its own (dup), so that a region unregistered meanwhile never
has its descriptor closed, nor reused, under a copy.
"""
import asyncio
import math
import os
from typing import Callable, List, Optional, Tuple, cast

import numpy as np

from engine.http import body
from engine.http.errors import BadRequest, NotFound, allowed
from engine.http.oip import region_files
from engine.http.oip.regions import Record, Regions
from engine.http.oip.request import Parsed
from engine.http.oip.tensors import ShmRef
from engine.http.values import NUMPY, json_object

INLINE_BYTES = 1 << 20
REGISTER_BODY_BYTES = 4096  # {key, offset, byte_size}: a key is at most 255 characters

# a copy: (fd, array, position in the object, what the refusal names)
Job = Tuple[int, np.ndarray, int, str]


async def route(regions: Regions, parts: List[str], method: str, scope,
                receive) -> Optional[list]:
    """The answer's JSON of a route under /v2/systemsharedmemory/ (parts:
    the path after it); None for an empty body."""
    if parts == ["status"]:
        allowed(method, "GET")
        return regions.status()
    if parts == ["unregister"]:
        allowed(method, "POST")
        await body.read(scope, receive, REGISTER_BODY_BYTES, "an unregister request")
        regions.unregister()
        return None
    if len(parts) == 3 and parts[0] == "region":
        name, action = parts[1], parts[2]
        if action == "status":
            allowed(method, "GET")
            return regions.status(name)
        if action in ("register", "unregister"):
            allowed(method, "POST")
            raw = await body.read(scope, receive, REGISTER_BODY_BYTES, f"a {action} request")
            if action == "unregister":
                regions.unregister(name)
                return None
            regions.register(name, json_object(raw, 'a JSON object {"key", "offset", '
                                                   '"byte_size"}'))
            return None
    raise NotFound(f"no route /v2/systemsharedmemory/{'/'.join(parts)}: expected status, "
                   f"unregister, or region/NAME/status, register or unregister")


async def read_inputs(regions: Regions, model, parsed: Parsed) -> List[np.ndarray]:
    """parsed's arrays, each input given in a region read from it; the
    outputs that go to regions checked first, when their shapes are fixed."""
    regions.refresh()
    _check_outputs(regions, model, parsed)
    arrays = list(parsed.arrays)
    jobs: List[Job] = []
    for i, datatype, shape, ref in parsed.regions:
        where = f"input {model.inputs[i][0]!r}"
        record, fd = regions.resolve(ref.region, where)
        array = arrays[i] = np.empty(shape, NUMPY[datatype])
        jobs.append((fd, array, _position(record, ref, where), where))
    await _copy(region_files.read_into, jobs)
    return cast(List[np.ndarray], arrays)  # every None filled


async def write_outputs(regions: Regions, outputs: list) -> list:
    """outputs ((name, array, how) each) with those whose how is a region
    written there, and how replaced by the parameters their answer carries."""
    regions.refresh()
    jobs: List[Job] = []
    answered = []
    for name, array, how in outputs:
        if isinstance(how, ShmRef):
            where = f"output {name!r}"
            _holds(how, array.nbytes, f"{array.dtype}{list(array.shape)}", where)
            record, fd = regions.resolve(how.region, where)
            jobs.append((fd, array, _position(record, how, where), where))
            ref, how = how, {"shared_memory_region": how.region,
                             "shared_memory_byte_size": array.nbytes}
            if ref.offset:
                how["shared_memory_offset"] = ref.offset
        answered.append((name, array, how))
    await _copy(region_files.write_from, jobs)
    return answered


def _check_outputs(regions: Regions, model, parsed: Parsed) -> None:
    for i, name, how in parsed.wanted:
        if not isinstance(how, ShmRef):
            continue
        where = f"output {name!r}"
        record, _ = regions.resolve(how.region, where)
        _position(record, how, where)
        spec = model.outputs[i][1]
        if None not in spec.shape:
            dtype = np.dtype(spec.dtype)
            shape = [parsed.k, *spec.shape]
            _holds(how, math.prod(shape) * dtype.itemsize, f"{dtype}{shape}", where)


def _holds(ref: ShmRef, nbytes: int, what: str, where: str) -> None:
    if ref.byte_size < nbytes:
        raise BadRequest(f"{where}: shared_memory_byte_size: expected at least {nbytes} bytes "
                         f"(its {what}), got {ref.byte_size}")


def _position(record: Record, ref: ShmRef, where: str) -> int:
    """The tensor's position in the region's object; BadRequest unless it
    lies within the region."""
    if ref.offset + ref.byte_size > record.byte_size:
        raise BadRequest(f"{where}: expected shared_memory_offset + shared_memory_byte_size "
                         f"within region {record.name!r}'s {record.byte_size} bytes, got "
                         f"{ref.offset} + {ref.byte_size} = {ref.offset + ref.byte_size}")
    return record.offset + ref.offset


async def _copy(copy: Callable[[int, np.ndarray, int, str], None], jobs: List[Job]) -> None:
    if sum(array.nbytes for _, array, _, _ in jobs) <= INLINE_BYTES:
        for job in jobs:
            copy(*job)
        return
    own: List[Job] = []
    try:
        for fd, array, position, where in jobs:
            own.append((os.dup(fd), array, position, where))
    except OSError:  # out of descriptors: the server's fault, a 500
        for job in own:
            os.close(job[0])
        raise
    await asyncio.to_thread(_copy_all, copy, own)


def _copy_all(copy, jobs: List[Job]) -> None:
    """Runs in a thread: its descriptors closed by it, whatever happens to
    the request that waits."""
    try:
        for job in jobs:
            copy(*job)
    finally:
        for job in jobs:
            os.close(job[0])
