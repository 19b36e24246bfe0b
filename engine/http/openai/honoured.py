"""Which of a generation request's fields its engine honours: one rule, one table.

A field that would change the answer and that the engine cannot honour is
refused with a 400 naming it, never silently ignored: a client asking for
sampling (temperature 0.7, top_p, seed, ...) from an engine that answers
greedily is told so. FIELDS holds each such field with the values that leave
the answer as this server gives it (a greedy answer in text choices), and
whether an engine that samples (its config's `sampling`) honours it
(engine.http.openai.sampled builds its requests' Sampling of them). A field
that names one of a named-tensor engine's inputs is passed to the model
(engine.http.openai.fields) and so is the model's to honour: never refused
here. temperature 1 is allowed, being OpenAI's and vLLM's default that
clients send unasked; `n` > 1 and `seed` are allowed at temperature 0, where
every choice is the one greedy answer (as vLLM gives it). Any other field is
ignored, as OpenAI-compatible servers do.
"""
import dataclasses
from typing import Callable, Dict

from engine.http.openai.replies import bad
from engine.http.values import json_text

GREEDY = "answers greedily: its engine does not sample"
FORM = "gives text choices alone"


@dataclasses.dataclass(frozen=True)
class Rule:
    """fine(value, body): whether the field's value leaves the answer as
    this server gives it; expected: those values, in words; sampled: a
    sampling engine honours the field; why: what this server does instead."""

    fine: Callable[[object, dict], bool]
    expected: str
    sampled: bool = True
    why: str = GREEDY


def _number(value) -> bool:
    return type(value) in (int, float)  # never a bool


def _same(value, allowed) -> bool:
    if _number(allowed):
        return _number(value) and value == allowed
    return type(value) is type(allowed) and value == allowed


def _is(*allowed) -> Callable[[object, dict], bool]:
    """Absent, or one of the allowed values."""
    return lambda value, body: value is None or any(_same(value, a) for a in allowed)


def greedy(body: dict) -> bool:
    """Whether the request asks for the greedy answer (temperature 0; OpenAI's
    default temperature is 1)."""
    value = body.get("temperature")
    return _number(value) and value == 0


FIELDS: Dict[str, Rule] = {
    "temperature": Rule(_is(0, 1), "absent, 0 or 1"),
    "top_p": Rule(_is(1), "absent or 1"),
    "top_k": Rule(_is(0, -1), "absent, 0 or -1"),
    "min_p": Rule(_is(0), "absent or 0"),
    "n": Rule(lambda v, body: v is None or v == 1 or greedy(body),
              "absent or 1 unless temperature is 0"),
    "seed": Rule(lambda v, body: v is None or greedy(body), "absent unless temperature is 0"),
    "min_tokens": Rule(_is(0), "absent or 0"),
    "ignore_eos": Rule(_is(False), "absent or false"),
    "stop_token_ids": Rule(_is([]), "absent or []"),
    "logprobs": Rule(_is(False), "absent or false", why="gives no logprobs"),
    "top_logprobs": Rule(_is(0), "absent or 0", why="gives no logprobs"),
    "prompt_logprobs": Rule(_is(), "absent", sampled=False,
                            why="gives a prompt's logprobs through echo with logprobs alone"),
    "echo": Rule(_is(False), "absent or false", why=FORM),
    "presence_penalty": Rule(_is(0), "absent or 0", sampled=False),
    "frequency_penalty": Rule(_is(0), "absent or 0", sampled=False),
    "repetition_penalty": Rule(_is(1), "absent or 1", sampled=False),
    "logit_bias": Rule(_is({}), "absent or {}", sampled=False),
    "allowed_token_ids": Rule(_is([]), "absent or []", sampled=False),
    "bad_words": Rule(_is([]), "absent or []", sampled=False),
    "use_beam_search": Rule(_is(False), "absent or false", sampled=False),
    "include_stop_str_in_output": Rule(_is(False), "absent or false", sampled=False,
                                       why="gives an answer without its stop string"),
    "best_of": Rule(_is(1), "absent or 1", sampled=False, why=FORM),
    "suffix": Rule(_is(""), 'absent or ""', sampled=False, why=FORM),
    "tools": Rule(_is([]), "absent or []", sampled=False, why=FORM),
    "functions": Rule(_is([]), "absent or []", sampled=False, why=FORM),
    "response_format": Rule(_is({"type": "text"}), 'absent or {"type": "text"}',
                            sampled=False, why=FORM),
}


def refuse_unhonoured(served, body: dict) -> None:
    """A 400 naming the first field of body that would change the answer
    and that `served` (engine.http.openai.fields.Served) cannot honour."""
    sampling = served.sampling
    for field, rule in FIELDS.items():
        if field in served.input_names or (sampling and rule.sampled):
            continue
        value = body.get(field)
        if not rule.fine(value, body):
            raise bad(f"{field}: model {served.model!r} {rule.why}: expected {field} "
                      f"{rule.expected}, got {json_text(value)}", field)
