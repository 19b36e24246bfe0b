"""[engines.NAME.openai]: an engine also served on the OpenAI API, checked against its tensors.

    [engines.chat.openai]
    tokenizer = "mymodel:tokenizer"   # module:factory, called once in each HTTP worker
    model = "chat"                    # the name clients pass as "model" (default: the engine's)
    input = "input_ids"               # named tensors: the token ids' input (default: the one
    output = "token"                  #   integer input with a variable dim; the one output)
    defaults = {temperature = 1.0}    # named tensors: the other inputs' values when a request
                                      #   lacks the field of that name
    max_prompt_chars = 200000         # a longer text is refused before it is tokenized
                                      #   (default: the input's bound x the longest token)
    task = "rerank"                   # a one-shot engine's: "embed" (the default) or "rerank"

An iterative engine serves /v1/completions and /v1/chat/completions (task
"generate", its only one): its token input is integers [None], one step's
output an integer ([] or [1]; a sampling engine's, its own "token"). A
one-shot engine serves /v1/embeddings (task "embed"): the same input, its
output floats [d]; or /v1/rerank (task "rerank"): a query and a document as
one input, its output a score (a float [] or [1]). Every other input of a
named-tensor engine is filled from the request's field of its name, else
from `defaults`.

Everything here is checked in serve's own process, before anything starts;
nothing is imported (the tokenizer is loaded in each HTTP worker).
"""
import dataclasses
from typing import Dict, List, Optional

import numpy as np

from engine.config import EngineConfig
from engine.errors import InvalidInput
from engine.http.errors import BadRequest
from engine.http.openai.replies import OpenAIError, bad
from engine.http.values import datatype_of, value_array
from engine.tensors import TensorSpec

KEYS = ("tokenizer", "model", "input", "output", "defaults", "max_prompt_chars", "task")
GENERATE, EMBED, RERANK = "generate", "embed", "rerank"


@dataclasses.dataclass(frozen=True)
class OpenAISettings:
    """One engine's openai table, validated; tensors by spec name ("" for
    the single-array form's)."""

    engine: str
    model: str
    tokenizer: str
    input: str
    output: str
    defaults: Dict[str, object]
    # the most characters a text (a prompt, the messages, an input) may have
    # before it is tokenized; None: the engine's bound times the tokenizer's
    # longest token (engine.http.openai.tokenizing)
    max_prompt_chars: Optional[int] = None
    task: str = GENERATE  # what the engine does: GENERATE (iterative), EMBED or RERANK

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse(engine: str, table, config: EngineConfig) -> OpenAISettings:
    """The settings of [engines.ENGINE.openai]; ValueError naming what was
    expected and what came."""
    where = f"[engines.{engine}.openai]"
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table of {', '.join(KEYS)}, got "
                         f"{type(table).__name__} {table!r}")
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; expected some of "
                         f"{', '.join(KEYS)}")
    tokenizer = table.get("tokenizer")
    module, sep, attr = str(tokenizer).partition(":")
    if not isinstance(tokenizer, str) or not (module and sep and attr):
        raise ValueError(f"{where}: expected tokenizer = \"module:factory\", got "
                         f"{tokenizer!r}")
    model = table.get("model", engine)
    if not isinstance(model, str) or not model or len(model) > 256:
        raise ValueError(f"{where}: expected model = a name of 1 to 256 characters, got "
                         f"{model!r}")
    task = _task(where, table.get("task"), config)
    token_input = _token_input(where, table.get("input"), config)
    output = _output(where, table.get("output"), config, task)
    defaults = _defaults(where, table.get("defaults", {}), config, token_input)
    max_chars = table.get("max_prompt_chars")
    if max_chars is not None and (type(max_chars) is not int or max_chars < 1):
        raise ValueError(f"{where}: expected max_prompt_chars = an integer >= 1, got "
                         f"{max_chars!r}")
    return OpenAISettings(engine, model, tokenizer, token_input.name, output.name, defaults,
                          max_chars, task)


def check_all(settings: List[OpenAISettings]) -> None:
    """ValueError if two engines are served under one model name."""
    seen: Dict[str, str] = {}
    for s in settings:
        if s.model in seen:
            raise ValueError(f"[engines.{s.engine}.openai]: expected a model name of its own, got "
                             f"model = {s.model!r}, engine {seen[s.model]!r}'s too")
        seen[s.model] = s.engine


def _task(where: str, task, config: EngineConfig) -> str:
    tasks = (GENERATE,) if config.iterative else (EMBED, RERANK)
    if task is None:
        return tasks[0]
    if task not in tasks:
        kind = "an iterative" if config.iterative else "a one-shot"
        raise ValueError(f"{where}: {kind} engine's task is one of {list(tasks)}, got "
                         f"task = {task!r}")
    return task


def _token_input(where: str, name: Optional[str], config: EngineConfig) -> TensorSpec:
    specs = config.input_specs
    if name is not None and not config.named:
        raise ValueError(f"{where}: input names a named tensor; engine {config.name!r} has one "
                         f"unnamed input, got input = {name!r}")
    if name is not None:
        found = [s for s in specs if s.name == name]
        if not found:
            raise ValueError(f"{where}: expected input = one of {[s.name for s in specs]}, got "
                             f"{name!r}")
    else:
        found = [s for s in specs if _is_ids(s)]
        if len(found) != 1:
            raise ValueError(f"{where}: expected input = the name of the token ids' input (the "
                             f"engine has {len(found)} integer input(s) of one variable dim: "
                             f"{[s.name for s in found]}), got none")
    spec = found[0]
    if not _is_ids(spec):
        raise ValueError(f"{where}: expected the token ids' input to be integers [None] (one "
                         f"variable dim), got {spec.name or 'the input'} "
                         f"{spec.dtype}{list(spec.shape)}")
    return spec


def _is_ids(spec: TensorSpec) -> bool:
    return np.dtype(spec.dtype).kind in "iu" and spec.shape == (None,)


def _output(where: str, name: Optional[str], config: EngineConfig, task: str) -> TensorSpec:
    specs = config.output_specs
    if config.sampling:  # its outputs are the engine's own: the token, then its logprobs
        if name not in (None, "token"):
            raise ValueError(f"{where}: a sampling engine's token is its output \"token\"; "
                             f"expected no output, got output = {name!r}")
        return specs[0]
    if name is not None and not config.named:
        raise ValueError(f"{where}: output names a named tensor; engine {config.name!r} has one "
                         f"unnamed output, got output = {name!r}")
    found = specs if name is None else [s for s in specs if s.name == name]
    if len(found) != 1:
        raise ValueError(f"{where}: expected output = one of {[s.name for s in specs]}, got "
                         f"{name!r}")
    spec = found[0]
    kind = np.dtype(spec.dtype).kind
    if config.iterative and not (kind in "iu" and spec.shape in ((), (1,))):
        raise ValueError(f"{where}: an iterative engine's step gives one token id: expected its "
                         f"output to be an integer [] or [1], got {spec.dtype}{list(spec.shape)}")
    if task == RERANK and not (kind == "f" and spec.shape in ((), (1,))):
        raise ValueError(f"{where}: a reranker answers a score: expected its output to be a "
                         f"float [] or [1], got {spec.dtype}{list(spec.shape)}")
    if task == EMBED and not (kind == "f" and len(spec.shape) == 1):
        raise ValueError(f"{where}: a one-shot engine answers an embedding: expected its output "
                         f"to be floats [d], got {spec.dtype}{list(spec.shape)}")
    return spec


def _defaults(where: str, defaults, config: EngineConfig, token_input: TensorSpec) -> dict:
    others = [s.name for s in config.input_specs if s is not token_input]
    if not isinstance(defaults, dict):
        raise ValueError(f"{where}: expected defaults = a table {{input = value}}, got "
                         f"{defaults!r}")
    unknown = sorted(set(defaults) - set(others))
    if unknown:
        raise ValueError(f"{where}: defaults: expected inputs among {others}, got "
                         f"{', '.join(unknown)}")
    specs = {s.name: s for s in config.input_specs}
    for name, value in defaults.items():
        try:
            input_array(specs[name], value, f"defaults.{name}")
        except OpenAIError as e:
            raise ValueError(f"{where}: {e}") from None
    return dict(defaults)


def input_array(spec: TensorSpec, value, field: str) -> np.ndarray:
    """A field's JSON value as the engine's input `spec` (a single number fills
    a fixed shape); OpenAIError(400) otherwise."""
    try:
        array = value_array(value, datatype_of(spec.dtype), field)
    except BadRequest as e:
        raise bad(str(e), field) from None
    if array.ndim == 0 and spec.shape and None not in spec.shape:
        array = np.full(spec.shape, array, array.dtype)
    try:
        spec.check(array)
    except InvalidInput as e:
        raise bad(f"{field}: {e}", field) from None
    return array
