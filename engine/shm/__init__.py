"""The shared memory's lowest layer: the C ring's binding, its constants, the
segment's size, and who owns a slot and whether it still lives.

`ring` wraps each C call and `codes` names the C's constants; `sizing` says
whether a segment fits /dev/shm; `reaper` and `liveness` judge the owners of
slots. engine.segment, a floor up, creates and maps a segment from a config.
"""
