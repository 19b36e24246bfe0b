"""The Open Inference Protocol (KServe v2 REST, as Triton serves it).

`routes` the protocol's routes over the front's engines; `tensors` tensors
in JSON and binary (a body's bytes in, a response's out); `request` an
infer read against its engine, and the body limits derived from it;
`generate` Triton's generate extension for iterative engines; `repository`
Triton's model repository extension (index, load, unload); `sysshm`
Triton's system shared-memory extension (its routes, an infer's tensors in
regions), over `regions` the table of registered regions every worker shares
and `region_files` the regions' objects, opened only when safe and copied by
offset; `stats` Triton's statistics extension, read from each engine's segment.
"""
