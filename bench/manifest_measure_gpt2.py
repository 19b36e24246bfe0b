"""`shmbatch manifest --measure` on a served torch GPT-2, then that config
served by `shmbatch serve` inside a cgroup v1 memory controller whose limit
is the one the manifest wrote, answering N requests, each checked.

    /work/venv-torch/bin/python bench/manifest_measure_gpt2.py [--requests 100]

Needs root (a group under /sys/fs/cgroup/memory, and /proc/sys/vm/drop_caches
so that the libraries' file pages are charged to the group as in a fresh
pod, unless --keep-caches) and torch + transformers in the interpreter that
runs it (a venv: pip install torch==2.13.0 transformers). Nothing is
downloaded. The model is the README's gpt2.py: Greedy, each step recomputing
the running requests' sequences, left-padded, of a GPT-2 of random weights
from a seed at GPT2Config's default sizes (12 layers, 124M parameters), one
torch thread a batcher; its OpenAI table's tokenizer, loaded in each HTTP
worker, a byte-level BPE trained at start. The batchers and the HTTP worker
import this file as `manifest_measure_gpt2` (serve runs in its folder).

Each answer is checked against the model's own answer to its prompt alone
(Greedy with that one request). Prints the figures measured, the request and
limit written, the group's peak usage (memory.max_usage_in_bytes), its OOM
kills, and the answers.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
CGROUP = pathlib.Path("/sys/fs/cgroup/memory")
MIB = 1 << 20
NAME = "gpt2-demo"
MAX_PROMPT, STEPS, MAX_BATCH = 16, 8, 8
TEXT = "Hello, my name is Ada. Once upon a time there was a cafe in Zurich: 5 francs a cup."
CONFIG = f"""\
http_port = 8000
http_workers = 1
[engines.{NAME}]
backend = "manifest_measure_gpt2:Greedy"
iterative = true
input_shape = ["none"]
max_input_shape = [{MAX_PROMPT}]
input_dtype = "int64"
output_shape = []
output_dtype = "int64"
max_steps = {STEPS}
max_batch_size = {MAX_BATCH}
instances = 2
openai = {{tokenizer = "manifest_measure_gpt2:tokenizer"}}
"""


# -- the model, as the README's gpt2.py (imported by the batchers and the HTTP worker) --------

def tokenizer():
    """A transformers tokenizer without a download: a byte-level BPE trained on TEXT."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT] * 20, vocab_size=400, special_tokens=["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


class Greedy:
    def __init__(self, threads: int = 1, seed: int = 0):
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.model, self.seqs = GPT2LMHeadModel(GPT2Config()).eval(), {}

    def join(self, ids, batch, lengths):
        self.seqs.update((i, row[:n].tolist()) for i, row, n in zip(ids.tolist(), batch, lengths))

    @torch.inference_mode()
    def step(self, ids):
        seqs = [self.seqs[i] for i in ids.tolist()]
        x = torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in seqs], True, -1, "left")
        mask = (x >= 0).long()
        out = self.model(x.clamp(min=0), attention_mask=mask, logits_to_keep=1,
                         position_ids=mask.cumsum(1).clamp(min=1) - 1).logits[:, -1].argmax(-1)
        for s, token in zip(seqs, out.tolist()):
            s.append(token)
        return out.numpy(), [False] * len(ids)

    def leave(self, ids):
        for i in ids.tolist():
            del self.seqs[i]


def alone(model: Greedy, prompt: list) -> list:
    """The model's answer to one prompt, with no other request beside it."""
    model.join(np.array([0]), np.array([prompt]), [len(prompt)])
    try:
        return [int(model.step(np.array([0]))[0][0]) for _ in range(STEPS)]
    finally:
        model.leave(np.array([0]))


# -- the run ----------------------------------------------------------------------------------

def environment() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def manifest(config: pathlib.Path) -> tuple:
    """(the Deployment's comment text, request MiB, limit MiB, seconds) of --measure."""
    import yaml
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "engine", "manifest", "kubernetes", "--config",
                           str(config), "--image", "shmbatch:demo", "--measure"], cwd=HERE,
                          env=environment(), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"manifest --measure failed: {done.stderr}")
    seconds = time.monotonic() - start
    deployment = next(d for d in yaml.safe_load_all(done.stdout) if d["kind"] == "Deployment")
    serve = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    note = " ".join(line.strip()[2:] for line in done.stdout.splitlines()
                    if line.strip().startswith("# "))
    return (note, int(serve["requests"]["memory"][:-2]), int(serve["limits"]["memory"][:-2]),
            seconds)


def await_ready(proc, out_path: pathlib.Path, timeout_s: float = 900.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in out_path.read_text().splitlines():
            if " ready (pid " in line and "http://" in line:
                return "http://" + line.split("http://", 1)[1].split()[0]
        if proc.poll() is not None:
            raise SystemExit(f"serve exited ({proc.returncode}): {out_path.read_text()[-3000:]}")
        time.sleep(0.2)
    raise SystemExit(f"serve not ready within {timeout_s:g} s")


def generate(url: str, prompt: list) -> list:
    body = json.dumps({"INPUT": prompt, "parameters": {"timeout": 600_000_000}}).encode()
    request = urllib.request.Request(f"{url}/v2/models/{NAME}/generate", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=900) as reply:
        return json.loads(reply.read())["OUTPUT"]


def read(group: pathlib.Path, name: str) -> str:
    return (group / name).read_text().strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=5, help="distinct prompts, sent in turn")
    parser.add_argument("--concurrency", type=int, default=MAX_BATCH)
    parser.add_argument("--keep-caches", action="store_true",
                        help="do not drop the page cache before serve starts in the group")
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, GPT2Config().vocab_size, int(n)).tolist()
               for n in rng.integers(4, MAX_PROMPT + 1, args.prompts)]
    folder = pathlib.Path(tempfile.mkdtemp(prefix="shmbatch-gpt2-"))
    config = folder / "gpt2.toml"
    config.write_text(CONFIG)

    sys.path.insert(0, str(ROOT))  # this tree's engine, as serve's PYTHONPATH
    from engine.tools.manifest_measure import tree_memory
    note, request_mib, limit_mib, measure_s = manifest(config)
    memory = note[note.index("memory: "):note.index(" grace ")]
    print(f"manifest --measure ({measure_s:.0f} s): request {request_mib} MiB, limit "
          f"{limit_mib} MiB\n  {memory}\n")
    model = Greedy()
    expected = [alone(model, p) for p in prompts]
    del model

    if not args.keep_caches:  # as in a fresh pod: the libraries' file pages charged to the group
        pathlib.Path("/proc/sys/vm/drop_caches").write_text("1")
    group = CGROUP / f"shmbatch-gpt2-{os.getpid()}"
    group.mkdir()
    out_path = folder / "serve.out"
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit_mib * MIB))
        with open(out_path, "w") as out:  # the shell joins the group, then becomes serve
            proc = subprocess.Popen(
                ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group),
                 sys.executable, "-m", "engine", "serve", "--config", str(config),
                 "--http-port", "0"], cwd=HERE, env=environment(), stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            start = time.monotonic()
            url = await_ready(proc, out_path)
            ready_s = time.monotonic() - start
            ready_usage = int(read(group, "memory.usage_in_bytes"))
            start = time.monotonic()
            with ThreadPoolExecutor(args.concurrency) as pool:
                answers = list(pool.map(lambda i: generate(url, prompts[i % len(prompts)]),
                                        range(args.requests)))
            serve_s = time.monotonic() - start
            # what the group holds once they are answered, and the processes' PSS as measured
            usage = int(read(group, "memory.usage_in_bytes"))
            stat = {k: int(v) for k, v in (line.split() for line in
                                           read(group, "memory.stat").splitlines())}
            pss = tree_memory(proc.pid)[0]
        finally:
            proc.terminate()
            code = proc.wait(120)
        right = sum(a == expected[i % len(prompts)] for i, a in enumerate(answers))
        oom = dict(line.split() for line in read(group, "memory.oom_control").splitlines())
        peak = int(read(group, "memory.max_usage_in_bytes"))
        print(f"serve in a cgroup of {limit_mib} MiB: ready in {ready_s:.0f} s using "
              f"{ready_usage / MIB:.0f} MiB; {args.requests} requests ({args.prompts} prompts, "
              f"{args.concurrency} at a time, {STEPS} tokens each) in {serve_s:.0f} s; "
              f"{right} of {len(answers)} answers equal to the prompt's answer alone")
        print(f"peak usage (memory.max_usage_in_bytes) {peak / MIB:.0f} MiB = "
              f"{100 * peak / (limit_mib * MIB):.0f} % of the limit; failcnt "
              f"{read(group, 'memory.failcnt')}, oom_kill {oom.get('oom_kill')}")
        print(f"after the requests: usage {usage / MIB:.0f} MiB, working set (usage - inactive "
              f"file) {(usage - stat['total_inactive_file']) / MIB:.0f} MiB; anon (rss) "
              f"{stat['total_rss'] / MIB:.0f} MiB, page cache {stat['total_cache'] / MIB:.0f} "
              f"MiB of which mapped {stat['total_mapped_file'] / MIB:.0f} MiB and shmem "
              f"{stat.get('total_shmem', 0) / MIB:.0f} MiB; the processes' PSS outside "
              f"/dev/shm {pss / MIB:.0f} MiB")
        print(f"serve exited {code}; left in /dev/shm: "
              f"{[p for p in os.listdir('/dev/shm') if NAME in p]}")
        print("first answer:", answers[0], "expected:", expected[0])
        return 0 if right == len(answers) == args.requests and code == 0 else 1
    finally:
        for _ in range(100):  # empty once serve and its children have exited
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


if __name__ == "__main__":
    raise SystemExit(main())
