"""aiperf's profile of the README's generative model over the OpenAI API, with
ignore_eos: every answer exactly --osl tokens, at several concurrencies.

    PYTHONPATH=TREE:TREE/bench python bench/aiperf_tinygpt.py \
        --aiperf /work/venv-aiperf/bin/aiperf [--concurrency 1,8,32] [--isl 64] [--osl 64]

Serves examples/tinygpt.toml unchanged (its `tinygpt` engine: TinyGPT,
sampling=True) and runs `aiperf profile --endpoint-type completions
--streaming --extra-inputs ignore_eos:true --use-server-token-count` against
it, all offline: aiperf's tokenizer (it makes the synthetic prompts) is the
byte tokenizer lm_eval_check.py builds, whose ids are the server's. The
server's own counts are used because a byte tokenizer's text of random
tokens holds replacement characters that re-tokenize longer. Prints one row a
concurrency; exits 1 unless every answer had exactly --osl tokens.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from lm_eval_check import byte_tokenizer, serve


def profile(aiperf: str, url: str, tokenizer: str, concurrency: int, isl: int, osl: int,
            out: str) -> dict:
    count = max(16, 4 * concurrency)
    argv = [aiperf, "profile", "--model-names", "tinygpt", "--url", f"http://{url}",
            "--endpoint-type", "completions", "--streaming", "--tokenizer", tokenizer,
            "--isl", str(isl), "--isl-stddev", "0", "--osl", str(osl), "--osl-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
            "--concurrency", str(concurrency), "--request-count", str(count),
            "--warmup-request-count", str(min(concurrency, 8)), "--random-seed", "1",
            "--artifact-dir", out, "--ui-type", "none"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        print(run.stdout[-3000:], run.stderr[-3000:])
        raise SystemExit(f"aiperf failed: exit {run.returncode}")
    with open(os.path.join(out, "profile_export_aiperf.json")) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--aiperf", default="aiperf")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--isl", type=int, default=64)
    parser.add_argument("--osl", type=int, default=64)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="aiperf_tinygpt-")
    tokenizer = os.path.join(folder, "tokenizer")
    byte_tokenizer(tokenizer)
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")])}
    proc, url = serve(folder, "readme", 0, env)
    rows, exact = [], True
    try:
        for c in (int(v) for v in args.concurrency.split(",")):
            d = profile(args.aiperf, url, tokenizer, c, args.isl, args.osl,
                        os.path.join(folder, f"c{c}"))
            osl = d["output_sequence_length"]
            exact = exact and osl["min"] == osl["max"] == args.osl
            rows.append(f"| {c} | {int(d['request_count']['avg'])} | "
                        f"{d.get('error_request_count', {}).get('avg', 0) or 0:.0f} | "
                        f"{osl['min']:.0f} / {osl['avg']:.0f} / {osl['max']:.0f} | "
                        f"{d['output_token_throughput']['avg']:.0f} | "
                        f"{d['time_to_first_token']['p50']:.0f} | "
                        f"{d['inter_token_latency']['p50']:.2f} |")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print("| concurrency | requests | errors | output tokens min / mean / max | output tokens/s "
          "| TTFT p50 ms | ITL p50 ms |")
    print("|---:|---:|---:|---|---:|---:|---:|")
    print("\n".join(rows))
    print("OK" if exact else "MISMATCH: an answer's length was not --osl")
    sys.exit(0 if exact else 1)


if __name__ == "__main__":
    main()
