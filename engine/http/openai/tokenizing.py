"""A caller's text made token ids at a bounded cost, off the event loop when it is long.

A text is refused by its length in characters before it is tokenized: a
model's input holds at most `bound` tokens and a token is at most
`chars_per_token` characters (the tokenizer's longest token, read from its
vocabulary, or the openai table's max_prompt_chars), so a longer text can
never fit and costs nothing but its length check. A text that may fit is
tokenized on the loop when it is short (INLINE_CHARS: well under a
millisecond), else in the worker's tokenizer threads: at most THREADS of
them, with at most QUEUED texts waiting for one, so that one caller's long
text delays the others by no more than the loop's share of the GIL while a
pure-Python tokenizer runs (a Rust one, as transformers' fast tokenizers
are, releases it). A chat template runs there too.

Token ids are checked against the vocabulary (`vocab_size`): ids a caller
sends before they reach the model, ids a model answers before they are
decoded.
"""
import asyncio
import concurrent.futures
from typing import Any, Callable, Optional

INLINE_CHARS = 4096
THREADS = 2
QUEUED = 64
# a token's characters when the tokenizer shows no vocabulary to read it from
DEFAULT_CHARS_PER_TOKEN = 64


def chars_per_token(tokenizer) -> int:
    """The most characters one token's text can hold: the longest entry of the
    tokenizer's vocabulary (a byte-level or SentencePiece entry is at least as
    long as the text it decodes to), else DEFAULT_CHARS_PER_TOKEN."""
    vocab = getattr(tokenizer, "get_vocab", None)
    try:
        entries = vocab() if callable(vocab) else None
    except Exception:
        entries = None
    if not entries:
        return DEFAULT_CHARS_PER_TOKEN
    return max(1, max(len(str(entry)) for entry in entries))


def vocab_size(tokenizer) -> Optional[int]:
    """How many token ids the tokenizer knows (ids 0 .. n - 1), or None when it
    does not say: len(tokenizer) (a transformers tokenizer's, added tokens
    included), else its vocab_size."""
    for size in (_len(tokenizer), getattr(tokenizer, "vocab_size", None)):
        if type(size) is int and size > 0:
            return size
    return None


def _len(tokenizer) -> Optional[int]:
    try:
        return len(tokenizer)
    except TypeError:
        return None


class Tokenizing:
    """The worker's tokenizer threads (one set for all its models)."""

    def __init__(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(THREADS,
                                                          thread_name_prefix="shmbatch-tokenizer")
        self._queued: Optional[asyncio.Semaphore] = None

    async def run(self, chars: int, work: Callable[..., Any], *args: Any) -> Any:
        """work(*args), for a text of `chars` characters: on the loop when it is
        short, else in a tokenizer thread."""
        if chars <= INLINE_CHARS:
            return work(*args)
        if self._queued is None:
            self._queued = asyncio.Semaphore(QUEUED)
        async with self._queued:
            return await asyncio.get_running_loop().run_in_executor(self.pool, work, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
