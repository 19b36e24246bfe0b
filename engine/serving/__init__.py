"""Running an engine: the supervisor and the processes it keeps alive.

`supervisor.Engine` creates the segment, starts the batchers (`processes`,
through the one child launcher `launch`), restarts them (`restarts`), swaps
them on a reload (`reloading`), answers the control socket (`control`) and
exports metrics (`metrics`, and under vLLM's and Triton's names `metrics_compat`); `notify` tells a service manager it is ready,
and `admission_log` says, bounded, when requests are refused.
"""
