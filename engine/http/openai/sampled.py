"""A generation request's sampling on an engine that samples: its engine.Sampling, from the body.

On an engine whose config says `sampling`, each engine request carries an
engine.Sampling built here from OpenAI's fields (temperature, default 1,
top_p, seed, logprobs; chat's logprobs and top_logprobs; completions' echo)
and vLLM's (top_k, -1 or 0 off; min_p, min_tokens, ignore_eos,
stop_token_ids). Each field is checked here, a bad one a 400 naming it,
what was expected and what came. A field that names an input of a
named-tensor engine is the model's (engine.http.openai.fields), not read here.

Seeds: OpenAI's seed is any integer; Sampling's is a u64, so a seed is taken
mod 2**64 (deterministic; -1 is 2**64 - 1). Choice 0 of a prompt samples
with that seed, so n = 1 and the first of n choices agree; choice c > 0 with
the first 8 bytes of BLAKE2b(seed as 8 bytes little-endian, c as 8 bytes
little-endian, person "shmbatch-choice"), so a seeded request's choices
differ and none is a neighbouring seed's choice 0.

The tokenizer's eos ends the answer (the route's rule); on a sampling engine
it is also one of the request's stop_token_ids (unless ignore_eos), so that
min_tokens masks it in the engine as it masks the engine's own eos ids.
logprobs ask the engine for at least 1 top logprob, so that each chunk holds
the token's logprob (a chunk of 0 is the token alone); the route cuts the
top ids to what the request asked.
"""
import dataclasses
import hashlib
import math
from typing import Optional, Tuple

from engine.errors import InvalidInput
from engine.http.openai.replies import bad
from engine.http.values import json_text
from engine.sampling import MAX_STOP_TOKEN_IDS, MAX_TOKEN_ID, Sampling

SEEDS = 2**64
_PERSON = b"shmbatch-choice"


def choice_seed(seed: int, choice: int) -> int:
    """A prompt's choice `choice` (0..n-1): its seed, from the request's (in 0..2**64-1)."""
    if choice == 0:
        return seed
    digest = hashlib.blake2b(seed.to_bytes(8, "little") + choice.to_bytes(8, "little"),
                             digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "little")


@dataclasses.dataclass(frozen=True)
class Asked:
    """What a request asks of the sampler: `base` its Sampling without a
    seed; seed (0..2**64-1) or None; logprobs: the top logprobs of each
    token it answers (None: no logprobs); echo: the prompt's text first (and
    with logprobs its tokens' logprobs, from the engine's prompt logprobs)."""

    base: Sampling
    seed: Optional[int]
    logprobs: Optional[int]
    echo: bool

    @property
    def greedy(self) -> bool:
        return self.base.greedy

    def of_choice(self, choice: int) -> Sampling:
        """The engine.Sampling of a prompt's choice."""
        if self.seed is None:
            return self.base
        return dataclasses.replace(self.base, seed=choice_seed(self.seed, choice))


def asked(served, body: dict, chat: bool, max_steps: Optional[int]) -> Asked:
    """The request's sampling on `served` (engine.http.openai.fields.Served,
    an engine that samples), every field checked; max_steps the request's
    (None: the engine's)."""
    config = served.config
    own = lambda name: None if name in served.input_names else body.get(name)  # noqa: E731
    temperature = _number(own("temperature"), "temperature", 1.0, 0.0, math.inf,
                          "a finite number >= 0")
    top_p = _number(own("top_p"), "top_p", 1.0, 0.0, 1.0, "a number in (0, 1]", open_low=True)
    min_p = _number(own("min_p"), "min_p", 0.0, 0.0, 1.0, "a number in [0, 1]")
    top_k = _integer(own("top_k"), "top_k", 0, -1, MAX_TOKEN_ID,
                     f"-1 or 0 (off), or an integer in 1..{MAX_TOKEN_ID}")
    most_steps = max_steps or config.max_steps
    min_tokens = _integer(own("min_tokens"), "min_tokens", 0, 0, most_steps,
                          f"an integer in 0..{most_steps} (the request's max_tokens)")
    seed = own("seed")
    if seed is not None and type(seed) is not int:
        raise bad(f"seed: expected an integer, got {json_text(seed)}", "seed")
    ignore_eos = _flag(own("ignore_eos"), "ignore_eos")
    eos = served.eos
    add_eos = not ignore_eos and eos is not None and eos not in config.eos_token_ids
    stops = _stop_ids(own("stop_token_ids"), served.vocab, MAX_STOP_TOKEN_IDS - add_eos)
    if add_eos and eos not in stops:
        stops += (eos,)
    logprobs, echo = (_chat_logprobs if chat else _completion_logprobs)(served, own)
    prompt = None
    if echo and logprobs is not None:
        if not config.prompt_logprobs:
            raise bad(f"echo: with logprobs, the prompt's logprobs: model {served.model!r}'s "
                      f"engine gives none; expected echo false or no logprobs (or the engine "
                      f"started with prompt_logprobs=True), got echo true, logprobs {logprobs}",
                      "echo")
        prompt = logprobs
    try:
        base = Sampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                        min_tokens=min_tokens, ignore_eos=ignore_eos, stop_token_ids=stops,
                        logprobs=0 if logprobs is None else max(logprobs, 1),
                        prompt_logprobs=prompt)
    except InvalidInput as e:  # checked above: a refusal here names what Sampling says
        raise bad(str(e), str(e).partition(":")[0].partition("[")[0]) from None
    return Asked(base, None if seed is None else seed % SEEDS, logprobs, echo)


def _completion_logprobs(served, own) -> Tuple[Optional[int], bool]:
    """(completions' logprobs: k top logprobs per token, or None; echo)."""
    if own("top_logprobs") is not None:
        raise bad(f"top_logprobs: /v1/completions takes logprobs (an integer, the top "
                  f"logprobs of each token); expected top_logprobs absent, got "
                  f"{json_text(own('top_logprobs'))}", "top_logprobs")
    value = own("logprobs")
    if value is None:
        return None, _flag(own("echo"), "echo")
    most = _most_logprobs(served, "logprobs")
    if type(value) is not int or not 0 <= value <= most:
        raise bad(f"logprobs: expected an integer in 0..{most} (the top logprobs of each "
                  f"token; model {served.model!r}'s engine gives at most {most}), got "
                  f"{json_text(value)}", "logprobs")
    return value, _flag(own("echo"), "echo")


def _chat_logprobs(served, own) -> Tuple[Optional[int], bool]:
    """(chat's top_logprobs when logprobs is true, else None; echo: never)."""
    if own("echo") is not None and own("echo") is not False:
        raise bad(f"echo: /v1/chat/completions does not echo the messages; expected echo "
                  f"absent or false, got {json_text(own('echo'))}", "echo")
    wanted = _flag(own("logprobs"), "logprobs")
    top = own("top_logprobs")
    if top is not None and not wanted:
        raise bad(f"top_logprobs: needs logprobs true; expected top_logprobs absent, got "
                  f"{json_text(top)}", "top_logprobs")
    if not wanted:
        return None, False
    most = _most_logprobs(served, "logprobs")
    if top is None:
        return 0, False
    if type(top) is not int or not 0 <= top <= most:
        raise bad(f"top_logprobs: expected an integer in 0..{most} (model {served.model!r}'s "
                  f"engine gives at most {most}), got {json_text(top)}", "top_logprobs")
    return top, False


def _most_logprobs(served, field: str) -> int:
    most = served.config.max_logprobs
    if not most:
        raise bad(f"{field}: model {served.model!r}'s engine gives no logprobs (its "
                  f"max_logprobs is 0); expected {field} absent", field)
    return most


def _number(value, field: str, default: float, lo: float, hi: float, expected: str,
            open_low: bool = False) -> float:
    if value is None:
        return default
    if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi \
            or (open_low and value == lo):
        raise bad(f"{field}: expected {expected}, got {json_text(value)}", field)
    return float(value)


def _integer(value, field: str, default: int, lo: int, hi: int, expected: str) -> int:
    if value is None:
        return default
    if type(value) is not int or not lo <= value <= hi:
        raise bad(f"{field}: expected {expected}, got {json_text(value)}", field)
    return value


def _flag(value, field: str) -> bool:
    if value is not None and type(value) is not bool:
        raise bad(f"{field}: expected true or false, got {json_text(value)}", field)
    return bool(value)


def _stop_ids(value, vocab: Optional[int], most: int) -> Tuple[int, ...]:
    if value is None:
        return ()
    top = MAX_TOKEN_ID if vocab is None else vocab - 1
    expected = (f"stop_token_ids: expected a list of at most {most} token ids in 0..{top}, got ")
    if not isinstance(value, list) or len(value) > most:
        shown = f"a list of {len(value)}" if isinstance(value, list) else json_text(value)
        raise bad(expected + shown, "stop_token_ids")
    for i in value:
        if type(i) is not int or not 0 <= i <= top:
            raise bad(f"{expected}{json_text(i)} among them", "stop_token_ids")
    return tuple(dict.fromkeys(value))
