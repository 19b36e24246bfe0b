"""Running an engine: the supervisor and the processes it keeps alive.

`supervisor.Engine` creates the segment, starts the batchers (`processes`,
through the one child launcher `launch`), restarts them (`restarts`), swaps
them on a reload (`reloading`), answers the control socket (`control`) and
exports metrics (`metrics`, and under vLLM's and Triton's names
`metrics_compat`); `notify` tells a service manager it is ready,
`admission_log` says, bounded, when requests are refused, and `catalog` tells
a serve's HTTP workers which engines it has now.
"""
