"""Text and token ids for the OpenAI API: the tokenizer hook, incremental decoding, stop strings.

A tokenizer is what a `module:factory` returns: an object with encode(text)
-> list[int], decode(ids) -> str and, for chat, apply_chat_template(messages,
add_generation_prompt=True, tokenize=True) -> list[int]; its eos_token_id,
if set, ends a request. A transformers tokenizer has all of them.

Detokenizer turns the token ids of an answer into text as they come, without
ever splitting a character: a byte-level tokenizer's token may hold part of a
UTF-8 sequence, which decodes to U+FFFD until the rest comes, and a
SentencePiece one's text depends on the token before. So each new token's
text is the decode of a short window of ids less the decode of the same
window without the new ones, held back while it ends in U+FFFD (as TGI and
vLLM do). The concatenated pieces are the answer's text.

Stops cuts the text at the first stop string: it holds back the longest end
of the text that could begin one, so no text past or including a stop
string is ever handed out, even when one spans several tokens.
"""
import importlib
from typing import Iterable, List, Optional, Tuple

import numpy as np

REPLACEMENT = "\ufffd"  # what a decoder makes of an incomplete UTF-8 sequence


class TokenizerFailed(ValueError):
    """A tokenizer factory that does not load, or returns no tokenizer."""


def load(spec: str, engine: str):
    """The tokenizer that `spec` ("module:factory") makes, checked; TokenizerFailed
    naming the engine otherwise."""
    where = f"engine {engine!r}: [engines.{engine}.openai] tokenizer {spec!r}"
    module, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
        tokenizer = factory()
    except Exception as e:
        raise TokenizerFailed(f"{where}: {type(e).__name__}: {e}") from None
    missing = [m for m in ("encode", "decode") if not callable(getattr(tokenizer, m, None))]
    if missing:
        raise TokenizerFailed(f"{where}: expected an object with encode(text) and decode(ids), "
                              f"got {type(tokenizer).__name__} without {', '.join(missing)}")
    return tokenizer


def eos_of(tokenizer) -> Optional[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return int(eos) if isinstance(eos, (int, np.integer)) and not isinstance(eos, bool) else None


def id_list(ids, what: str) -> List[int]:
    """The token ids a tokenizer gave (a list, an array, a transformers
    BatchEncoding, or a batch of one) as a list of ints; ValueError otherwise."""
    if hasattr(ids, "keys") and "input_ids" in ids:
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list):
        ids = ids[0]
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise ValueError(f"the tokenizer's {what}: expected a list of ints, got "
                         f"{type(ids).__name__}")
    return ids


class Detokenizer:
    """The text of an answer, piece by piece, as its token ids come."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode
        self.ids: List[int] = []
        self.prefix = 0       # the window's first id
        self.read = 0         # ids before this are handed out as text
        self.prefix_text = ""  # decode(ids[prefix:read])

    def add(self, token: int) -> str:
        """The text that token completes ("" while a character is unfinished)."""
        self.ids.append(token)
        text = self.decode(self.ids[self.prefix:])
        if len(text) <= len(self.prefix_text) or text.endswith(REPLACEMENT):
            return ""
        piece = text[len(self.prefix_text):]
        self.prefix, self.read = self.read, len(self.ids)
        self.prefix_text = self.decode(self.ids[self.prefix:self.read])
        return piece

    def flush(self) -> str:
        """What the last ids hold that add() held back (an answer that ends
        mid-character ends with U+FFFD, as a whole decode would)."""
        if self.read == len(self.ids):
            return ""
        piece = self.decode(self.ids[self.prefix:])[len(self.prefix_text):]
        self.prefix = self.read = len(self.ids)
        self.prefix_text = ""
        return piece


class Stops:
    """Text cut at the first of the stop strings."""

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""  # text held back: it may begin a stop string

    def feed(self, text: str) -> Tuple[str, bool]:
        """(the text that may be handed out now, whether a stop string came)."""
        if not self.stops:
            return text, False
        pending = self.pending + text
        at = min((i for i in (pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if at >= 0:
            self.pending = ""
            return pending[:at], True
        held = max((_overlap(pending, s) for s in self.stops), default=0)
        self.pending = pending[len(pending) - held:] if held else ""
        return pending[:len(pending) - held], False

    def flush(self) -> str:
        """The text held back, once the answer ended without a stop string."""
        text, self.pending = self.pending, ""
        return text


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of text that is a proper beginning of stop."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
