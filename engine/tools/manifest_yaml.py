"""YAML text for the manifests, without a YAML library (PyYAML is not a
dependency of shmbatch): mappings, lists, strings, numbers, booleans, null,
and comments.

A key that is a Comment writes its text as `# ` lines at that place in its
mapping (its value is ignored); a document's own comment goes above it. A
string is written plain only when YAML 1.1 and 1.2 both read it back as that
same string; otherwise double-quoted (JSON's escapes are YAML's), or as a
literal block when it spans lines.
"""
import json
import re
from typing import Iterable, Tuple

_PLAIN = re.compile(r"-{0,2}[A-Za-z/][A-Za-z0-9_./-]*\Z")
# words a YAML 1.1 reader (PyYAML, kubectl's older parser) takes for booleans or null
_SPECIAL = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf"}


class Comment(str):
    """A mapping key that is written as a comment, not a key."""


def scalar(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"no YAML for the number {value!r} in a manifest")
        text = repr(value)  # YAML 1.1 reads 1e-05 as a string: its mantissa needs a dot
        mantissa, e, exponent = text.partition("e")
        return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text
    if isinstance(value, str):
        if _PLAIN.match(value) and value.lower() not in _SPECIAL:
            return value
        return json.dumps(value)
    raise TypeError(f"no YAML for {type(value).__name__} {value!r}")


def _block(text: str) -> bool:
    """Whether a string is written as a literal block: several lines, no
    character a block would change (a first line's indent, a carriage return,
    control characters)."""
    return ("\n" in text.rstrip("\n") and not text[:1].isspace()
            and all(c == "\n" or c == "\t" or (c.isprintable() and c != "\r") for c in text))


def _literal(text: str, indent: str) -> list:
    chomp = "-" if not text.endswith("\n") else ("+" if text.endswith("\n\n") else "")
    body = text[:-1] if text.endswith("\n") else text
    return [f"|{chomp}"] + [f"{indent}{line}" if line else "" for line in body.split("\n")]


def _comment_lines(text: str, indent: str) -> list:
    return [f"{indent}# {line}".rstrip() for line in str(text).split("\n")]


def _value(value, indent: str, out: list, head: str) -> None:
    """head (e.g. `key:` or `-`) and the value after it, or below it."""
    if isinstance(value, dict) and _keys(value):
        out.append(head)
        _mapping(value, indent + "  ", out)
    elif isinstance(value, (list, tuple)) and value:
        out.append(head)
        _sequence(value, indent + "  ", out)
    elif isinstance(value, dict):
        out.append(f"{head} {{}}")
    elif isinstance(value, (list, tuple)):
        out.append(f"{head} []")
    elif isinstance(value, str) and _block(value):
        lines = _literal(value, indent + "  ")
        out.append(f"{head} {lines[0]}")
        out.extend(lines[1:])
    else:
        out.append(f"{head} {scalar(value)}")


def _keys(mapping: dict) -> list:
    return [k for k in mapping if not isinstance(k, Comment)]


def _mapping(mapping: dict, indent: str, out: list) -> None:
    for key, value in mapping.items():
        if isinstance(key, Comment):
            out.extend(_comment_lines(key, indent))
            continue
        if not isinstance(key, str):
            raise TypeError(f"a manifest's keys are strings, got {key!r}")
        _value(value, indent, out, f"{indent}{scalar(key)}:")


def _sequence(items, indent: str, out: list) -> None:
    for item in items:
        if isinstance(item, dict) and _keys(item):
            # the item's first keys on the dash's line; comments before it go above the dash
            leading = []
            for key in item:
                if not isinstance(key, Comment):
                    break
                leading.append(key)
            for key in leading:
                out.extend(_comment_lines(key, indent))
            lines = []
            _mapping({k: v for k, v in item.items() if k not in leading}, indent + "  ", lines)
            out.append(f"{indent}- {lines[0][len(indent) + 2:]}")
            out.extend(lines[1:])
        else:
            _value(item, indent, out, f"{indent}-")


def dump(value) -> str:
    """One YAML document's text (a mapping or a list at the top)."""
    out: list = []
    if isinstance(value, dict):
        _mapping(value, "", out)
    elif isinstance(value, (list, tuple)):
        _sequence(value, "", out)
    else:
        out.append(scalar(value))
    return "\n".join(out) + "\n"


def documents(docs: Iterable[Tuple[str, dict]]) -> str:
    """A stream of documents, each (its comment or '', the object), separated by ---."""
    parts = []
    for comment, obj in docs:
        text = "\n".join(_comment_lines(comment, "")) + "\n" if comment else ""
        parts.append("---\n" + text + dump(obj))
    return "".join(parts)
