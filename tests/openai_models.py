"""Tokenizers and models of tests/test_openai_*.py (importable by batchers and HTTP
workers): answers that can be checked exactly against each request.

Bytes: a byte-level tokenizer. A token id is a byte of the text's UTF-8
(0..255), EOS (256) its eos_token_id, so a character of several bytes comes
in several tokens; decode() replaces an unfinished sequence with U+FFFD, as
a transformers byte-level tokenizer does. Its chat template writes each
message as "<|role|>content\\n" and, for the generation prompt, "<|assistant|>".

Echo (a step model over int64[None] token ids, one int64 token per step)
answers its prompt's tokens back, one per step, then EOS (or its `eos`), then "." forever
(never done: only EOS, a stop string or max_tokens ends it). Marks in the
prompt: the byte DONE (0x04) is answered and the model says done with it;
the byte FAIL (0x15) makes the step that would answer it raise (unless `marks`
is false: a tokenizer of other ids). `step_ms` makes each step take that long
(a request that holds its slot).

Tagged (named tensors: input_ids int64[None], seed int64[1], temperature
float32[1]; output token int64) answers f"{seed}:{temperature:.2f}:" then its
prompt as Echo does: the answer says which values came.

Numbered answers f"{k}:" then its prompt as Echo does, k the requests its
batcher joined before it: the order they joined in.

embedder (one-shot: int64[None] -> float32[4]) answers each request's
(length, sum, first, last) of its token ids. scorer (one-shot: int64[None] ->
float32[]) answers a (query, document) pair of ids, joined by EOS (as the
routes join Bytes' pairs), its relevance(): the share of the query's
distinct bytes that the document holds.

Letters is a tokenizer whose ids are texts, one letter each, for the V = 50
logit model of tests/logit_models.py (a sampling engine's).

Counted is Bytes that says its vocabulary's size (257: EOS the last id);
Gated's encode() of a text that begins "GATE:path:" makes path.entered, then
waits until the file path exists (a tokenizer as slow as a test needs); Broken's decode() raises at
the byte BROKEN. Beyond answers its prompt, then the id OUTSIDE (past
Counted's vocabulary), then EOS.
"""
import os
import time

import numpy as np

EOS = 256
DONE, FAIL = 0x04, 0x15
BROKEN, OUTSIDE = 0x7F, 1000
GATE_S = 60.0
DOT = ord(".")


class Bytes:
    """The byte-level tokenizer."""

    eos_token_id = EOS

    def encode(self, text: str) -> list:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>"
        return self.encode(text) if tokenize else text


class NoEos(Bytes):
    """Bytes without an eos_token_id: only max_tokens or a stop string ends Echo."""

    eos_token_id = None


class Plain:
    """encode and decode alone: no chat template."""

    eos_token_id = EOS
    encode, decode = Bytes.encode, Bytes.decode


class Counted(Bytes):
    vocab_size = EOS + 1


class Gated(Counted):
    def encode(self, text: str) -> list:
        if text.startswith("GATE:"):
            path = text.split(":", 2)[1]
            open(path + ".entered", "w").close()
            deadline = time.monotonic() + GATE_S
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.01)  # a tokenizer at work for as long as the test holds the gate
        return super().encode(text)


class Broken(Counted):
    def decode(self, ids) -> str:
        if BROKEN in ids:
            raise ValueError("Broken cannot decode its BROKEN byte")
        return super().decode(ids)


def counted_tokenizer():
    return Counted()


def gated_tokenizer():
    return Gated()


def broken_tokenizer():
    return Broken()


def bytes_tokenizer():
    return Bytes()


def no_eos_tokenizer():
    return NoEos()


def plain_tokenizer():
    return Plain()


def failing_tokenizer():
    raise RuntimeError("no vocabulary here")


HF_TEXT = "Hello, my name is Ada. Once upon a time there was a café in Zürich: €5 a cup. 😀"


def hf_tokenizer():
    """A transformers tokenizer (a byte-level BPE trained on HF_TEXT: no download),
    with a chat template; its eos "<|endoftext|>" is id 0."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([HF_TEXT] * 20, vocab_size=400, special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tok.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return tok


LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWX"  # one per id of a V = 50 model


class Letters:
    """A tokenizer whose ids are texts: id i is the letter LETTERS[i] (50 ids,
    the vocabulary of tests/logit_models.py), id 0 ("a") its eos. Its chat
    template writes each message's content, then "X"."""

    eos_token_id = 0
    vocab_size = len(LETTERS)

    def encode(self, text: str) -> list:
        return [LETTERS.index(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(LETTERS[i] for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        text = "".join(m["content"] for m in messages) + ("X" if add_generation_prompt else "")
        return self.encode(text) if tokenize else text


def letters_tokenizer():
    return Letters()


def rendered(messages) -> str:
    """The chat template's text of messages, with the generation prompt: what Echo answers."""
    return Bytes().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class Echo:
    def __init__(self, step_ms: float = 0.0, eos: int = EOS, marks: bool = True):
        self.step_ms, self.eos = float(step_ms), int(eos)
        self.done, self.fail = (DONE, FAIL) if marks else (None, None)
        self.state = {}  # id -> [answer's ids, next index]

    def join(self, ids, batch, lengths=None):
        for rid, row, n in zip(ids.tolist(), batch, lengths.tolist()):
            self.state[rid] = [self.prefix(rid, row) + row[:n].tolist() + [self.eos], 0]

    def prefix(self, rid, row) -> list:
        return []

    def step(self, ids):
        if self.step_ms:
            from engine.shm import ring
            ring.spin_ns(int(self.step_ms * 1e6))
        out, done = np.empty(len(ids), np.int64), np.zeros(len(ids), bool)
        for k, rid in enumerate(ids.tolist()):
            answer, i = self.state[rid]
            token = answer[i] if i < len(answer) else DOT
            if token == self.fail:
                raise RuntimeError(f"Echo fails at token {i}")
            out[k], done[k] = token, token == self.done
            self.state[rid][1] = i + 1
        return out, done

    def leave(self, ids):
        for rid in ids.tolist():
            self.state.pop(rid, None)


def echo(step_ms: float = 0.0, eos: int = EOS, marks: bool = True):
    return Echo(step_ms, eos, marks)


class Beyond(Echo):
    def join(self, ids, batch, lengths=None):
        for rid, row, n in zip(ids.tolist(), batch, lengths.tolist()):
            self.state[rid] = [row[:n].tolist() + [OUTSIDE, self.eos], 0]


def beyond():
    return Beyond()


class Tagged(Echo):
    def join(self, ids, batch, lengths=None):
        self.tags = {rid: f"{int(s[0])}:{float(t[0]):.2f}:".encode() for rid, s, t in
                     zip(ids.tolist(), batch["seed"], batch["temperature"])}
        super().join(ids, batch["input_ids"], lengths["input_ids"])

    def prefix(self, rid, row) -> list:
        return list(self.tags.pop(rid))

    def step(self, ids):
        out, done = super().step(ids)
        return {"token": out}, done


def tagged(step_ms: float = 0.0):
    return Tagged(step_ms)


class Numbered(Echo):
    joined = 0

    def prefix(self, rid, row) -> list:
        self.joined += 1
        return list(f"{self.joined - 1}:".encode())


def numbered(step_ms: float = 0.0):
    return Numbered(step_ms, marks=False)


def embedding(ids) -> list:
    """Its oracle: what embedder answers for these token ids."""
    return [float(len(ids)), float(sum(ids)), float(ids[0]), float(ids[-1])]


def relevance(ids) -> float:
    """Its oracle: what scorer answers for these ids (query, EOS, document)."""
    split = ids.index(EOS) if EOS in ids else len(ids)
    query, document = set(ids[:split]), set(ids[split + 1:])
    return len(query & document) / len(query) if query else 0.0


def scorer():
    def run(batch, lengths):
        return np.array([relevance(row[:n].tolist()) for row, n in zip(batch, lengths.tolist())],
                        np.float32)
    return run


def embedder():
    def run(batch, lengths):
        out = np.zeros((len(batch), 4), np.float32)
        for k, (row, n) in enumerate(zip(batch, lengths.tolist())):
            out[k] = embedding(row[:n].tolist())
        return out
    return run
