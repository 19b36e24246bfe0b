"""lm-eval's local-completions against a served sampling engine; each loglikelihood it
reports checked against the model alone on the same ids.

    PYTHONPATH=TREE:TREE/bench python bench/lm_eval_check.py \
        --lm-eval /work/venv-lmeval/bin/lm_eval [--model readme|causal] [--docs 32] [--out DIR]

Everything is offline. `--model readme` (the default) serves the README's
examples/tinygpt.toml unchanged and calls its `tinygpt` engine (TinyGPT,
sampling=True, prompt_logprobs=True, the byte tokenizer); lm-eval tokenizes
with a transformers tokenizer built here whose ids are a text's UTF-8 bytes and
256 its end, as examples/bytetok.py's are. `--model causal` serves a causal
numpy logit model over a byte-level BPE trained here on the tasks' own words:
the logits after a prefix p are A[p[-1]] + B[sum(p) % V] / 2 (A, B fixed random
[V, V]), in join and step alike.

Two tasks from jsonl files written here (lm-eval's custom task YAML,
dataset_path: json): a multiple-choice one (`shm_mc`, 4 choices a doc: one
loglikelihood request per choice, lm-eval's echo + logprobs request) and a
generate_until one (`shm_gen`, until "\n", 8 tokens at most, temperature 0),
--batch_size 4 (lists of 4 prompts per request). Then every loglikelihood
sample lm-eval logged (--log_samples) is recomputed: its context and
continuation tokenized as lm-eval does (trailing spaces of the context moved
to the continuation; the continuation the whole's ids past the context's),
summed with the model alone in float64 (every position's logits of one
forward pass), and compared: the largest difference must be within 1e-4, and
lm-eval's is_greedy must equal the model's argmax chain. Each generate_until
answer is checked against the model's greedy chain decoded and cut at "\n".
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import shutil

import numpy as np

WORDS = ("red green blue yellow black white cat dog bird fish horse apple pear plum "
         "one two three four five six seven eight nine ten north south east west "
         "sun moon star rain snow wind hot cold big small fast slow up down left right").split()
TOKENIZER_ENV = "SHMBATCH_LMEVAL_TOKENIZER"
SEED = 39
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def tokenizer():
    """The server's tokenizer factory: the one saved in $SHMBATCH_LMEVAL_TOKENIZER."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(os.environ[TOKENIZER_ENV])


def train_tokenizer(folder: str, corpus: str) -> int:
    """A byte-level BPE trained on corpus, saved in folder; its vocabulary's size."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([corpus], vocab_size=400, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tok.save_pretrained(folder)
    return len(tok)


def byte_tokenizer(folder: str) -> int:
    """A transformers tokenizer whose ids are a text's UTF-8 bytes and 256 its end
    (examples/bytetok.py's ids), saved in folder; its vocabulary's size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    # byte-level BPE's printable stand-in for each byte, as GPT-2's tokenizer maps them
    shown = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    char = {b: chr(b) for b in shown}
    char.update((b, chr(256 + k)) for k, b in enumerate(b for b in range(256) if b not in char))
    bpe = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tok.add_special_tokens({"eos_token": "<|endoftext|>"})
    assert tok.eos_token_id == 256 and tok("é €", add_special_tokens=False).input_ids == \
        list("é €".encode()), "the byte tokenizer's ids are not the text's bytes"
    tok.save_pretrained(folder)
    return len(tok)


class Causal:
    """A causal logit model of vocabulary `vocab`: logits(prefix) as the docstring says."""

    def __init__(self, vocab: int) -> None:
        rng = np.random.default_rng(SEED)
        self.a = rng.normal(0.0, 2.0, (vocab, vocab)).astype(np.float32)
        self.b = rng.normal(0.0, 2.0, (vocab, vocab)).astype(np.float32)
        self.vocab = vocab
        self.state: dict = {}  # request id -> its tokens so far

    def logits(self, prefix) -> np.ndarray:
        return self.a[prefix[-1]] + self.b[sum(prefix) % self.vocab] / 2

    def join(self, ids, x, lengths, positions=None):
        out = []
        for i, rid in enumerate(ids.tolist()):
            prefix = x[i, :lengths[i]].tolist()
            self.state[rid] = prefix
            if positions == "all":
                every = np.zeros((x.shape[1], self.vocab), np.float32)
                for j in range(len(prefix)):
                    every[j] = self.logits(prefix[:j + 1])
                out.append(every)
            else:
                out.append(self.logits(prefix))
        return np.stack(out)

    def step(self, ids, tokens):
        out = []
        for rid, token in zip(ids.tolist(), tokens.tolist()):
            self.state[rid].append(token)
            out.append(self.logits(self.state[rid]))
        return np.stack(out), np.zeros(len(ids), bool)

    def leave(self, ids):
        for rid in ids.tolist():
            self.state.pop(rid, None)


def steps(vocab: int) -> Causal:
    return Causal(vocab)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


class Alone:
    """The served model run alone: every position's logits of ids [L, V]."""

    def __init__(self, kind: str, vocab: int) -> None:
        if kind == "causal":
            model = Causal(vocab)
            self.every = lambda ids: np.stack([model.logits(ids[:j + 1])
                                               for j in range(len(ids))])
        else:
            import runpy
            tinygpt = runpy.run_path(os.path.join(EXAMPLES, "tinygpt.py"))["TinyGPT"]()
            one = np.zeros(1, np.int64)

            def every(ids):
                logits = tinygpt.join(one, np.array([ids]), np.array([len(ids)]), "all")[0]
                tinygpt.leave(one)
                return logits
            self.every = every

    def greedy(self, ids: list, steps: int) -> list:
        """ids with the model's greedy chain of `steps` tokens after them."""
        ids = list(ids)
        for _ in range(steps):
            ids.append(int(np.argmax(self.every(ids)[-1])))
        return ids


def loglikelihood(model: Alone, context: list, continuation: list):
    """(sum of the continuation's logprobs, whether it is the greedy chain), the model alone."""
    logits = model.every(list(context) + list(continuation))[len(context) - 1:-1]
    lps = [log_softmax(row) for row in logits]
    total = sum(lp[t] for lp, t in zip(lps, continuation))
    return total, all(int(np.argmax(lp)) == t for lp, t in zip(lps, continuation))


def write_tasks(folder: str, docs: int) -> str:
    """The two tasks' jsonl and YAML; the corpus the tokenizer trains on."""
    rng = np.random.default_rng(SEED)
    mc, gen = [], []
    for i in range(docs):
        words = [WORDS[k] for k in rng.choice(len(WORDS), 5, replace=False)]
        mc.append({"question": f"Which comes after {words[0]}?", "choices": words[1:],
                   "answer": int(rng.integers(4))})
        gen.append({"question": f"Say {words[0]} {words[1]}:", "answer": f" {words[2]}"})
    for name, rows in (("mc", mc), ("gen", gen)):
        with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
              f"{folder}/{{name}}.jsonl\ntest_split: test\n")
    with open(os.path.join(folder, "shm_mc.yaml"), "w") as f:
        f.write("task: shm_mc\n" + common.format(name="mc") +
                "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
                "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
                "metric_list:\n  - metric: acc\n")
    with open(os.path.join(folder, "shm_gen.yaml"), "w") as f:
        f.write("task: shm_gen\n" + common.format(name="gen") +
                "output_type: generate_until\ndoc_to_text: \"{{question}}\"\n"
                "doc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n"
                "  max_gen_toks: 8\n  temperature: 0\nmetric_list:\n  - metric: exact_match\n")
    return " ".join(json.dumps(r) for r in mc + gen) * 4


def serve(folder: str, kind: str, vocab: int, env: dict):
    """`shmbatch serve` of the model; (its process, its HTTP address)."""
    config = os.path.join(folder, "models.toml")
    if kind == "readme":  # the README's config as it is, its files beside it
        for name in ("tinygpt.toml", "tinygpt.py", "bytetok.py"):
            shutil.copy(os.path.join(EXAMPLES, name), folder)
        config = os.path.join(folder, "tinygpt.toml")
    else:
        with open(config, "w") as f:
            f.write("http_workers = 1\n[engines.lmeval]\nbackend = \"lm_eval_check:steps\"\n"
                    f"backend_args = {{vocab = {vocab}}}\niterative = true\nsampling = true\n"
                    "prompt_logprobs = true\nmax_logprobs = 5\ninput_shape = [\"none\"]\n"
                    "max_input_shape = [256]\ninput_dtype = \"int64\"\noutput_shape = []\n"
                    "output_dtype = \"int64\"\nmax_steps = 16\nmax_batch_size = 16\n"
                    "[engines.lmeval.openai]\ntokenizer = \"lm_eval_check:tokenizer\"\n")
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--config", config,
                             "--http-port", "0"], env=env, stdout=subprocess.PIPE, text=True,
                            cwd=folder)
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if "ready" in line:
            return proc, re.search(r"http://(\S+)", line).group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit(f"serve did not start (exit {proc.wait()})")


def check(out: str, tok_folder: str, model: Alone) -> dict:
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast.from_pretrained(tok_folder)

    def encode(text):
        return tok(text, add_special_tokens=False).input_ids

    worst, greedy_agree, n_ll, gen_ok, n_gen = 0.0, 0, 0, 0, 0
    for path in glob.glob(os.path.join(out, "**", "samples_shm_*.jsonl"), recursive=True):
        for line in open(path):
            sample = json.loads(line)
            for args, resp in zip(sample["arguments"].values(), sample["resps"]):
                context, rest = args["arg_0"], args["arg_1"]
                if isinstance(rest, str):  # a loglikelihood request
                    spaces = len(context) - len(context.rstrip())
                    if spaces:
                        context, rest = context[:-spaces], context[-spaces:] + rest
                    ctx = encode(context)
                    whole = encode(context + rest)
                    expected, greedy = loglikelihood(model, ctx, whole[len(ctx):])
                    got, got_greedy = resp[0]  # logged as strings: "-17.65", "False"
                    worst = max(worst, abs(float(got) - expected))
                    greedy_agree += str(got_greedy) == str(greedy)
                    n_ll += 1
                else:  # generate_until: the greedy chain, cut at "\n"
                    ids = model.greedy(encode(context), 8)
                    answer = tok.decode(ids[len(encode(context)):])
                    if tok.eos_token in answer:
                        answer = answer[:answer.index(tok.eos_token)]
                    gen_ok += resp[0] == answer.split("\n")[0]
                    n_gen += 1
    return {"loglikelihoods": n_ll, "max_abs_diff": worst, "is_greedy_agree": greedy_agree,
            "generations": n_gen, "generations_equal_greedy": gen_ok}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lm-eval", default="lm_eval")
    parser.add_argument("--model", choices=("readme", "causal"), default="readme")
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    folder = args.out or tempfile.mkdtemp(prefix="lm_eval_check-")
    os.makedirs(folder, exist_ok=True)
    tok_folder = os.path.join(folder, "tokenizer")
    corpus = write_tasks(folder, args.docs)
    vocab = byte_tokenizer(tok_folder) if args.model == "readme" else \
        train_tokenizer(tok_folder, corpus)
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, TOKENIZER_ENV: tok_folder, "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(here), here,
                                          os.environ.get("PYTHONPATH", "")])}
    proc, url = serve(folder, args.model, vocab, env)
    name = "tinygpt" if args.model == "readme" else "lmeval"
    try:
        began = time.monotonic()
        model_args = (f"base_url=http://{url}/v1/completions,model={name},"
                      f"tokenized_requests=True,tokenizer_backend=huggingface,"
                      f"tokenizer={tok_folder},max_length=256")
        run = subprocess.run([args.lm_eval, "run", "--model", "local-completions", "--model_args",
                              model_args, "--tasks", "shm_mc", "shm_gen", "--include_path",
                              folder, "--batch_size", "4", "--log_samples", "--output_path",
                              os.path.join(folder, "out")], env=env, capture_output=True,
                             text=True, timeout=600)
        wall_s = time.monotonic() - began
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if run.returncode != 0:
        print(run.stdout[-3000:], run.stderr[-6000:])
        raise SystemExit(f"lm_eval failed: exit {run.returncode}")
    print("\n".join(line for line in run.stdout.splitlines() if line.startswith("|")))
    figures = check(os.path.join(folder, "out"), tok_folder, Alone(args.model, vocab))
    print(json.dumps({"model": args.model, "vocab": vocab, "docs": args.docs, "lm_eval_wall_s": round(wall_s, 1),
                      **figures}))
    ok = (figures["loglikelihoods"] == 4 * args.docs and figures["max_abs_diff"] <= 1e-4
          and figures["is_greedy_agree"] == figures["loglikelihoods"]
          and figures["generations"] == args.docs
          and figures["generations_equal_greedy"] == args.docs)
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
