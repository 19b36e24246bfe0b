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

Stops cuts the text at the first stop string: the one whose occurrence ends
earliest in the answer's text; of stops ending at the same character, the
longest (so with "abcd" and "bc", "xabcd" is cut to "xa", at "bc"; with
"abcd" and "cd", to "x"). The answer is the text before that occurrence.
The cut depends on the text alone, never on how it came in pieces, and no
text past or including a stop string is ever handed out, even when one
spans several tokens. The stops are walked as one Aho-Corasick automaton (a
trie of them with failure links), each new character once, so a piece of
text costs time in its own length (amortised), however long the stops or
however often the answer nearly matches one. What is held back is the
longest end of the text that begins some stop (the automaton's state), and
nothing else.
"""
import importlib
from typing import Dict, Iterable, List, Optional, Tuple

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


class StopAutomaton:
    """The Aho-Corasick automaton of some stop strings: node 0 is the empty
    text; a node is a beginning of some stop, reached from its parent by one
    character, and falls back (fail) to its longest proper end that is a node."""

    def __init__(self, stops: Tuple[str, ...]) -> None:
        if not all(stops):
            raise ValueError("a stop string is never empty")
        self.stops = stops
        self.goto: Dict[int, int] = {}  # node << 21 | ord(char) -> node; one dict for all
        self.depth = [0]   # the length of the node's text
        self.owner = [0]   # a stop that the node's text begins
        for i, stop in enumerate(stops):
            node = 0
            for c in stop:
                key = node << 21 | ord(c)
                if key not in self.goto:
                    self.goto[key] = len(self.depth)
                    self.depth.append(self.depth[node] + 1)
                    self.owner.append(i)
                node = self.goto[key]
        self.fail = [0] * len(self.depth)
        # the length of the longest stop that ends the node's text, 0 if none
        self.match = [0] * len(self.depth)
        for stop in stops:
            node = 0
            for c in stop:
                node = self.goto[node << 21 | ord(c)]
            self.match[node] = len(stop)
        self._link()

    def _link(self) -> None:
        """Fail links and matches, breadth first: a node's fail is found from
        its parent's, which is shallower and so already linked."""
        children: List[List[Tuple[int, int]]] = [[] for _ in self.depth]
        for key, child in self.goto.items():
            children[key >> 21].append((key & 0x1FFFFF, child))
        todo = [child for _, child in children[0]]
        for node in todo:
            for o, child in children[node]:
                todo.append(child)
                back = self.fail[node]
                while back and (back << 21 | o) not in self.goto:
                    back = self.fail[back]
                self.fail[child] = self.goto.get(back << 21 | o, 0)
                if not self.match[child]:
                    self.match[child] = self.match[self.fail[child]]

    def text(self, node: int, length: int) -> str:
        """The first `length` characters of the node's text (a beginning of a stop)."""
        return self.stops[self.owner[node]][:length] if length > 0 else ""


class Stops:
    """Text cut at the first of the stop strings."""

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(stops)
        self.automaton = StopAutomaton(self.stops) if self.stops else None
        self.state = 0        # the automaton's node: its text is what is held back
        self.stopped = False
        self.steps = 0        # the automaton's moves so far (one per character, plus fails)

    def feed(self, text: str) -> Tuple[str, bool]:
        """(the text that may be handed out now, whether a stop string came)."""
        a = self.automaton
        if a is None:
            return text, False
        if self.stopped:
            return "", True
        goto, fail, match = a.goto, a.fail, a.match
        before = state = self.state
        fails = 0
        for i, c in enumerate(text):
            o = ord(c)
            nxt = goto.get(state << 21 | o)
            while nxt is None and state:
                state = fail[state]
                fails += 1
                nxt = goto.get(state << 21 | o)
            state = nxt or 0
            if match[state]:  # the earliest end of a stop: cut before its start
                self.steps += i + 1 + fails
                self.stopped, self.state = True, 0
                return self._cut(before, text, i + 1 - match[state]), True
        self.steps += len(text) + fails
        self.state = state
        return self._cut(before, text, len(text) - a.depth[state]), False

    def _cut(self, held: int, text: str, end: int) -> str:
        """The text held back at node `held`, then text[:end] (end < 0 cuts
        into what was held), copying only what is handed out."""
        assert self.automaton is not None
        depth = self.automaton.depth[held]
        if end <= 0:
            return self.automaton.text(held, depth + end)
        return self.automaton.text(held, depth) + text[:end]

    def flush(self) -> str:
        """The text held back, once the answer ended without a stop string."""
        if self.automaton is None or self.stopped:
            return ""
        a, node, self.state = self.automaton, self.state, 0
        return a.text(node, a.depth[node])
