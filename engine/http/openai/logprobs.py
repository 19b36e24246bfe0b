"""A choice's logprobs in OpenAI's shapes, gathered as its tokens come.

Each token of an answer (every one that usage counts: the eos and the token
that completed a stop string too, as vLLM gives them) has an entry: its
logprob and the top k ids and logprobs the engine wrote into its chunk. An
echoed prompt's tokens come first, their entries the engine's prompt
logprobs (the first token's None). A token reads as its text: the
tokenizer's decode of that one id (what vLLM and OpenAI answer; a token
that holds part of a character reads as U+FFFD), or "token_id:N" (vLLM's
form) for an id past the tokenizer's vocabulary, which the model's top ids
may hold. A logprob that is not finite (a masked token's -inf) is -9999.0,
as vLLM writes it: JSON has no infinity.

take() hands out the entries since the last take in the route's shape:

    completions: {"tokens": [text], "token_logprobs": [lp | None],
                  "top_logprobs": [{text: lp} | None], "text_offset": [int]}
        a top_logprobs dict holds the top k and the token itself (OpenAI's
        "up to logprobs + 1"); of two ids of one text, the likelier's logprob.
        text_offset: each token's offset in the choice's text, counted over
        the tokens' texts (the prompt's first with echo), as vLLM counts.
    chat: {"content": [{"token", "logprob", "bytes", "top_logprobs":
           [{"token", "logprob", "bytes"}] (k)}]}, bytes the text's UTF-8.
"""
import functools
import math
from typing import List, Optional

FLOOR = -9999.0


def texts_of(tokenizer, vocab: Optional[int]):
    """A token id's text, cached (an answer asks the same ids again and again)."""
    @functools.lru_cache(maxsize=1 << 16)
    def text(token: int) -> str:
        if token < 0 or (vocab is not None and token >= vocab):
            return f"token_id:{token}"
        return tokenizer.decode([token])
    return text


def _lp(value) -> float:
    value = float(value)
    return value if math.isfinite(value) else FLOOR


class Logprobs:
    """One choice's entries, k top logprobs each; text: texts_of's."""

    def __init__(self, text, k: int, chat: bool) -> None:
        self.text, self.k, self.chat = text, k, chat
        self.offset = 0  # the next token's text_offset
        self.ids: List[int] = []
        self.values: List[Optional[float]] = []
        self.tops: List[Optional[tuple]] = []  # (ids, logprobs), each a list

    def add(self, token: int, chunks, i: int) -> None:
        """The entry of a sampled token: row i of a block of chunks (a dict
        of "logprob" [n], "top_ids" [n, K], "top_logprobs" [n, K], K >= k)."""
        k = self.k
        self.ids.append(token)
        self.values.append(_lp(chunks["logprob"][i]))
        self.tops.append((chunks["top_ids"][i, :k].tolist(),
                          [_lp(v) for v in chunks["top_logprobs"][i, :k]]) if k else ([], []))

    def add_prompt(self, ids: List[int], entries: Optional[list]) -> None:
        """An echoed prompt's tokens: entries the stream's prompt_logprobs (None
        for the first token, else (logprob, top_ids, top_logprobs))."""
        entries = entries or []
        for j, token in enumerate(ids):
            entry = entries[j] if j < len(entries) else None
            self.ids.append(token)
            if entry is None:
                self.values.append(None)
                self.tops.append(None)
                continue
            value, top_ids, top_values = entry
            self.values.append(_lp(value))
            self.tops.append((top_ids[:self.k].tolist(), [_lp(v) for v in top_values[:self.k]]))

    def take(self) -> Optional[dict]:
        """The entries since the last take, in the route's shape (None if none)."""
        ids, values, tops = self.ids, self.values, self.tops
        if not ids:
            return None
        self.ids, self.values, self.tops = [], [], []
        text = self.text
        if self.chat:
            return {"content": [
                {**_chat_entry(text(t), v), "top_logprobs": [
                    _chat_entry(text(i), lp) for i, lp in zip(*top)] if top else []}
                for t, v, top in zip(ids, values, tops)]}
        tokens = [text(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {"tokens": tokens, "token_logprobs": values,
                "top_logprobs": [None if top is None else _top_dict(text, top, t, v)
                                 for t, v, top in zip(ids, values, tops)],
                "text_offset": offsets}


def _chat_entry(token: str, logprob) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}


def _top_dict(text, top: tuple, token: int, value: Optional[float]) -> dict:
    out: dict = {}
    for i, lp in zip(*top):
        out.setdefault(text(i), lp)
    out.setdefault(text(token), value)
    return out
