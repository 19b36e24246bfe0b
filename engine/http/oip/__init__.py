"""The Open Inference Protocol (KServe v2 REST, as Triton serves it).

`routes` the protocol's routes over the front's engines; `tensors` tensors
in JSON and binary (a body's bytes in, a response's out); `request` an
infer read against its engine, and the body limits derived from it;
`generate` Triton's generate extension for iterative engines; `repository`
Triton's model repository extension (index, load, unload); `stats` Triton's
statistics extension, read from each engine's segment.
"""
