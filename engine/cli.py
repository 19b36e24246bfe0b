"""The `shmbatch` command (contract section 4). serve/status/bench/cleanup
arrive with their issues; until then it prints its usage."""
import sys

USAGE = """usage: shmbatch {serve,status,bench,cleanup} ...
  serve    run an engine in the foreground (coming)
  status   live figures of a running engine (coming)
  bench    throughput versus max_batch_size (coming)
  cleanup  remove the segment of a dead engine (coming)"""


def main(argv=None) -> int:
    print(USAGE, file=sys.stderr)
    return 2
