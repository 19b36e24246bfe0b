"""The client side: a process attached to an engine's segment.

`client.Client` writes requests into slots and waits for their answers. Its
helpers (`futures` and the completer thread, `streams`, `bulk`, `lent`,
`room`) reach it only through `handle.Handle`, the typed interface it lends
them, and the completer settles its requests and async streams as
`handle.Item`s; `attach` maps the segment, `room` frees slots when the ring
is full, `waiting` and `answers` wait for and read one slot.
"""
