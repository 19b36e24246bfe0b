"""The `shmbatch` command (also `python -m engine`).

`commands` parses the command line and runs a command, `args` turns flags into
settings, `serve` runs engines with their HTTP and metrics ports until a
signal, `models` loads and unloads them under --model-control explicit, and
`tooling` runs the bench and tune commands (engine.tools, loaded only by
those commands).
"""
