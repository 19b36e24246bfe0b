"""CPU per token of an answer's stop-string matching (Stops.feed), for any tree.

    PYTHONPATH=TREE python bench/stops_cost.py N_STOPS STOP_CHARS run|cycle [TOKENS]

Stop i is a letter repeated STOP_CHARS - 1 times, then "!": the answer keeps
matching the start of stop 0 and never ends it. "run": the answer is "aaa...",
so the longest beginning of stop 0 is always held back; "cycle": near misses,
that beginning growing to its full length, then broken. Tokens of 4
characters, fed after the held-back text is already at its longest; the
median of 5 runs of process time.
"""
import statistics
import sys
import time

try:
    from engine.http.openai.text import Stops
except ImportError:  # a tree from before the HTTP front's families
    from engine.http.openai_text import Stops

TOKEN_CHARS = 4


def main() -> int:
    n, chars, answer = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 2000
    stops = ["abcdefghijklmnopqrstuvwxyz"[i] * (chars - 1) + "!" for i in range(n)]
    if answer == "run":
        text = "a" * (chars + TOKEN_CHARS * tokens)
    else:
        text = ("a" * (chars - 2) + "x") * (2 + TOKEN_CHARS * tokens // chars)
    runs = []
    for _ in range(5):
        s = Stops(stops)
        s.feed(text[:chars])
        pieces = [text[i:i + TOKEN_CHARS] for i in range(chars, chars + TOKEN_CHARS * tokens,
                                                          TOKEN_CHARS)]
        begun = time.process_time()
        for piece in pieces:
            s.feed(piece)
        runs.append((time.process_time() - begun) / len(pieces))
    print(f"{Stops.__module__}: {n} stops x {chars} chars, answer {answer}: median "
          f"{statistics.median(runs) * 1e6:.1f} us/token (runs: "
          + ", ".join(f"{r * 1e6:.1f}" for r in runs) + ")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
