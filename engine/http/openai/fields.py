"""An OpenAI request's fields read against the engine that serves its model.

Served is one engine on the API: its settings (engine.http.openai.settings),
tokenizer and tensors; it makes the engine's request of some token ids and
the request's other fields (each other input of a named-tensor engine from
the field of its name, else from its default). The functions read one field
each, refusing a bad one with a 400 that names the field, what was expected
and what came. A text is checked (valid Unicode, within its characters'
bound) before it is tokenized, and tokenized at a bounded cost
(engine.http.openai.tokenizing); token ids are checked against the
vocabulary; a prompt over the model's bound is OpenAI's
context_length_exceeded. Which fields that would change the answer an engine
honours is engine.http.openai.honoured's rule.
"""
import functools
from typing import Dict, List, Optional, Tuple

import numpy as np

from engine.config import EngineConfig
from engine.http.openai import logprobs, tokenizing
from engine.http.openai.replies import OpenAIError, bad
from engine.http.openai.settings import OpenAISettings, input_array
from engine.http.openai.text import eos_of, id_list
from engine.http.values import json_text

# an embeddings request's inputs, at most, as OpenAI's API reference bounds them; a
# completion's prompts and a rerank's documents too: each is an engine request, all
# enqueued at once (and never more than the engine's queue_capacity, which could not hold them)
MAX_INPUTS = 2048
MAX_CHOICES = 128  # n, at most: OpenAI's bound
DEFAULT_MAX_TOKENS = 16  # a completion's max_tokens when absent, as OpenAI's and vLLM's
MAX_STOPS = 4  # OpenAI's bound: "up to 4 sequences where the API will stop generating"
# OpenAI documents no bound on a stop's length; stops are delimiters ("\n\n", "</answer>",
# "\nUser:"), far shorter. A stream holds back text that might begin a stop, so a stop's
# length is how long a client may wait for text it could already have; 256 also caps a
# request's stop automaton at 1024 nodes.
MAX_STOP_CHARS = 256

class Served:
    """One engine on the OpenAI API; its texts tokenized through `tokens_of`."""

    def __init__(self, settings: OpenAISettings, config: EngineConfig, tokenizer,
                 tokens_of: tokenizing.Tokenizing) -> None:
        self.settings, self.config, self.tokenizer = settings, config, tokenizer
        self.tokens_of = tokens_of
        self.model, self.engine = settings.model, settings.engine
        self.eos = eos_of(tokenizer)
        # an empty prompt is completed from the model's start, as OpenAI's is
        bos = getattr(tokenizer, "bos_token_id", None)
        self.start = bos if type(bos) is int and bos >= 0 else self.eos
        self.vocab = tokenizing.vocab_size(tokenizer)
        specs = {s.name: s for s in config.input_specs}
        self.ids_spec = specs[settings.input]
        self.bound = self.ids_spec.max_shape[0]  # the most tokens a request's input holds
        self.max_chars = settings.max_prompt_chars or \
            self.bound * tokenizing.chars_per_token(tokenizer)
        self.others = [s for s in config.input_specs if s is not self.ids_spec]
        # fields that the model takes as inputs (engine.http.openai.honoured: its to honour)
        self.input_names = frozenset(s.name for s in self.others) if config.named else frozenset()
        # whether the engine samples: each request then carries its engine.Sampling
        # (engine.http.openai.sampled), and engine.http.openai.honoured lifts the refusal
        # of the fields it honours
        self.sampling = bool(config.sampling)
        self.defaults = {name: input_array(specs[name], value, f"defaults.{name}")
                         for name, value in settings.defaults.items()}

    def request(self, ids: List[int], body: dict, field: str, where: Optional[str] = None):
        """The engine's request of these token ids (from `field`; `where` names
        them in a refusal's message, `field` if not given) and body's other fields."""
        where = where or field
        if not ids:
            raise bad(f"{where}: expected at least 1 token, got none", field)
        if len(ids) > self.bound:
            raise too_long(f"{where}: expected at most {self.bound} tokens (the model's "
                           f"context), got {len(ids)}", field)
        if self.vocab is not None:
            outside = next((i for i in ids if not 0 <= i < self.vocab), None)
            if outside is not None:
                raise bad(f"{where}: expected token ids in 0..{self.vocab - 1} (the "
                          f"tokenizer's vocabulary), got {outside}", field)
        try:
            x = np.asarray(ids, self.ids_spec.dtype)
        except (OverflowError, ValueError, TypeError):
            raise bad(f"{where}: expected token ids that fit {self.ids_spec.dtype}, got "
                      f"{json_text(ids)}", field) from None
        if not self.config.named:
            return x
        request: Dict[str, np.ndarray] = {self.ids_spec.name: x}
        for spec in self.others:
            value = body.get(spec.name)
            if value is not None:
                request[spec.name] = input_array(spec, value, spec.name)
            elif spec.name in self.defaults:
                request[spec.name] = self.defaults[spec.name]
            else:
                raise bad(f"{spec.name}: expected a value ({spec.spec_text()}, an input of model "
                          f"{self.model!r} without a default), got none", spec.name)
        return request

    def tokens(self, chunks) -> List[int]:
        """The token ids of a block of chunks (n, *chunk shape): one each (a
        sampling engine's: the tokens alone, or a dict with their logprobs)."""
        if self.config.sampling:
            value = chunks["token"] if isinstance(chunks, dict) else chunks
        else:
            value = chunks[self.settings.output] if self.config.named else chunks
        return value.reshape(len(value)).tolist()

    @functools.cached_property
    def token_text(self):
        """A token id's text, for logprobs (engine.http.openai.logprobs)."""
        return logprobs.texts_of(self.tokenizer, self.vocab)

    @functools.cached_property
    def vector_size(self) -> int:
        """An embedding's values (the output's dims), worked out once."""
        specs = {s.name: s for s in self.config.output_specs}
        return int(np.prod(specs[self.settings.output].shape))

    @property
    def most_inputs(self) -> int:
        """The most inputs (prompts, documents) one request may have: each is an
        engine request, all enqueued at once."""
        return min(MAX_INPUTS, self.config.queue_capacity)

    def vector(self, answer) -> np.ndarray:
        return answer[self.settings.output] if self.config.named else answer

    def check_text(self, text: str, field: str, chars: Optional[int] = None) -> None:
        """BadRequest-worthy text refused before it costs a tokenizer's time:
        one over the characters a prompt may hold (chars: a text's whole
        length, for one made of parts), or one that is not valid Unicode.
        field may name one item of the field ("prompt[2]")."""
        chars = len(text) if chars is None else chars
        param = field.partition("[")[0]
        if chars > self.max_chars:
            raise too_long(f"{field}: expected at most {self.max_chars} characters (what "
                           f"{self.bound} tokens can hold), got {chars}", param)
        utf8(text, field, param)

    async def encode(self, text: str, field: str, where: Optional[str] = None) -> List[int]:
        """The token ids of a text (checked first: check_text; where names it
        in a refusal, field if not given)."""
        self.check_text(text, where or field)
        ids = await self.tokens_of.run(len(text), self.tokenizer.encode, text)
        try:
            return id_list(ids, "encode")
        except ValueError as e:
            raise OpenAIError(500, f"model {self.model!r}: {e}", field) from None


def max_steps(body: dict, fields: Tuple[str, ...], engine_max: int,
              default: Optional[int] = None, least: int = 1) -> Optional[int]:
    """The request's max_steps: the first of `fields` given, else `default`
    (at most the engine's; None: the engine's); `least` 0 where an echo of
    the prompt alone may be asked for."""
    for field in fields:
        value = body.get(field)
        if value is None:
            continue
        if type(value) is not int or not least <= value <= engine_max:
            echo = "" if least == 0 else "; 0 only with echo: the prompt alone"
            raise bad(f"{field}: expected an integer in [{least}, {engine_max}] (the engine's "
                      f"max_steps{echo}), got {json_text(value)}", field)
        return value
    return None if default is None else min(default, engine_max)


def choices(body: dict) -> int:
    """The request's `n`: how many choices each prompt gets, 1 to MAX_CHOICES."""
    value = body.get("n")
    if value is None:
        return 1
    if type(value) is not int or not 1 <= value <= MAX_CHOICES:
        raise bad(f"n: expected an integer in [1, {MAX_CHOICES}], got {json_text(value)}", "n")
    return value


def priority(body: dict, levels: int) -> int:
    """The engine's level of the request's `priority` (vLLM's: an integer,
    lower the more urgent, 0 the default): 0 and below the most urgent, the
    engine's last level and above the least."""
    value = body.get("priority")
    if value is None:
        return 0
    if type(value) is not int:
        raise bad(f"priority: expected an integer, lower the more urgent (0 or less: the "
                  f"engine's most urgent level, {levels - 1} or more: its least), got "
                  f"{json_text(value)}", "priority")
    return min(max(value, 0), levels - 1)


def stops(body: dict) -> List[str]:
    """The request's stop strings: at most MAX_STOPS, each 1 to MAX_STOP_CHARS characters."""
    value = body.get("stop")
    if value is None:
        return []
    got = [value] if isinstance(value, str) else value
    expected = (f"stop: expected a non-empty string of at most {MAX_STOP_CHARS} characters "
                f"or a list of at most {MAX_STOPS} of them, got ")
    if isinstance(got, list) and len(got) > MAX_STOPS:
        raise bad(f"{expected}a list of {len(got)}: {json_text(value)}", "stop")
    if not isinstance(got, list) or not all(isinstance(s, str) and s for s in got):
        raise bad(expected + json_text(value), "stop")
    for s in got:
        if len(s) > MAX_STOP_CHARS:
            raise bad(f"{expected}one of {len(s)} characters: {json_text(s)}", "stop")
    return got


def flag(body: dict, field: str) -> bool:
    value = body.get(field)
    if value is not None and type(value) is not bool:
        raise bad(f"{field}: expected true or false, got {json_text(value)}", field)
    return bool(value)


def include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad(f"stream_options: expected an object, got {json_text(options)}",
                  "stream_options")
    return flag(options, "include_usage")


def token_ids(value) -> Optional[List[int]]:
    """value as a list of token ids, or None if it is not one."""
    if isinstance(value, list) and value and all(type(i) is int for i in value):
        if any(i < 0 for i in value):
            return None
        return value
    return None


async def prompts_ids(served: Served, body: dict) -> List[List[int]]:
    """/v1/completions' prompt: a string, a list of token ids, or a list of
    either (several prompts), as token ids, one list per prompt; "" completes
    from the model's start. Their count is checked before any is tokenized,
    and every text before the first is."""
    prompts = prompt_items(body)
    several = prompts is body.get("prompt")  # a list of prompts, not one
    most = served.most_inputs
    if len(prompts) > most:
        raise bad(f"prompt: expected at most {most} prompts (each one engine request, all "
                  f"enqueued at once: {MAX_INPUTS}, or the engine's queue_capacity if "
                  f"smaller), got {len(prompts)}", "prompt")
    for k, p in enumerate(prompts):
        if isinstance(p, str):
            served.check_text(p, _nth("prompt", k, several))
    return [await _prompt_ids(served, p, _nth("prompt", k, several))
            for k, p in enumerate(prompts)]


def prompt_items(body: dict) -> list:
    """/v1/completions' prompts as the caller sent them, not yet checked: a
    list of several, or [the prompt]."""
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and bool(prompt) and all(
        isinstance(p, (str, list)) for p in prompt)
    return prompt if several else [prompt]  # type: ignore[return-value]


def _nth(field: str, k: int, several: bool) -> str:
    """How a refusal names the k-th of a field's items (the field itself when it has one)."""
    return f"{field}[{k}]" if several else field


async def _prompt_ids(served: Served, prompt, where: str) -> List[int]:
    if prompt == "":  # the model's start
        if served.start is None:
            raise bad(f"{where}: expected a text of at least one character (model "
                      f"{served.model!r} has no start token to complete from), got \"\"",
                      "prompt")
        return [served.start]
    if isinstance(prompt, str):
        return await served.encode(prompt, "prompt", where)
    ids = token_ids(prompt)
    if ids is None:
        raise bad(f"{where}: expected a string or a list of token ids (integers >= 0), or a "
                  f"list of such prompts, got {json_text(prompt)}", "prompt")
    return ids


async def chat_ids(served: Served, body: dict) -> List[int]:
    """/v1/chat/completions' messages through the tokenizer's chat template
    (their texts' length checked first)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad(f"messages: expected a non-empty list of {{\"role\", \"content\"}}, got "
                  f"{json_text(messages)}", "messages")
    clean = [_message(i, m) for i, m in enumerate(messages)]
    contents = [m.get("content") or "" for m in clean]
    chars = sum(map(len, contents))
    for content in contents:
        served.check_text(content, "messages", chars)
    template = getattr(served.tokenizer, "apply_chat_template", None)
    if not callable(template):
        raise bad(f"model {served.model!r}: its tokenizer has no apply_chat_template; "
                  f"expected /v1/completions", "messages")
    try:
        ids = await served.tokens_of.run(chars, _templated, template, clean)
    except Exception as e:
        raise bad(f"messages: the model's chat template refused them: {type(e).__name__}: {e}",
                  "messages") from None
    try:
        return id_list(ids, "apply_chat_template")
    except ValueError as e:
        raise OpenAIError(500, f"model {served.model!r}: {e}") from None


def _templated(template, messages: list):
    return template(messages, add_generation_prompt=True, tokenize=True)


def too_long(message: str, field: str) -> OpenAIError:
    """A text or prompt the model's context cannot hold, as OpenAI says it."""
    return OpenAIError(400, message, field, "context_length_exceeded")


def utf8(text: str, field: str, param: Optional[str] = None) -> None:
    """A 400 for text that is not valid Unicode (a lone surrogate that JSON's
    \\ud800 escape can carry and no encoder can write)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"{field}: expected valid Unicode text, got a lone surrogate "
                  f"(U+{ord(text[e.start]):04X}) at character {e.start}",
                  param or field) from None


def _message(i: int, message) -> dict:
    """A message with its content as text (a list of text parts joined)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad(f"{where}: expected {{\"role\": str, \"content\": ...}}, got "
                  f"{json_text(message)}", "messages")
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None
                 for p in content]
        if not all(isinstance(t, str) for t in texts):
            raise bad(f"{where}.content: expected text parts ({{\"type\": \"text\", \"text\": "
                      f"str}}), got {json_text(content)}", "messages")
        return {**message, "content": "".join(t for t in texts if t is not None)}
    if content is not None and not isinstance(content, str):
        raise bad(f"{where}.content: expected a string or a list of text parts, got "
                  f"{json_text(content)}", "messages")
    return message


async def embedding_inputs(served: Served, body: dict) -> List[List[int]]:
    """/v1/embeddings' input: a string, a list of strings, a list of token ids
    or a list of such lists, as one list of token ids per input. Their count
    is checked before any is tokenized, and each text before it is."""
    value = body.get("input")
    most = served.most_inputs
    if isinstance(value, list) and len(value) > most and not token_ids(value):
        raise bad(f"input: expected at most {most} inputs (OpenAI's bound, or the engine's "
                  f"queue_capacity if smaller), "
                  f"got {len(value)}", "input")
    if isinstance(value, str):
        return [await served.encode(value, "input")]
    ids = token_ids(value)
    if ids is not None:
        return [ids]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            for v in value:  # every text checked before the first is tokenized
                served.check_text(v, "input")
            return [await served.encode(v, "input") for v in value]
        lists = [token_ids(v) for v in value]
        if all(ids is not None for ids in lists):
            return lists  # type: ignore[return-value]
    raise bad(f"input: expected a string, a list of strings, a list of token ids (integers "
              f">= 0) or a list of such lists, got {json_text(value)}", "input")
