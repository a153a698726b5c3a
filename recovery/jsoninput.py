"""JSON that arrives from outside — an event on the API, a decision or a step's result a person
types in the console or gives ``manage.py recover`` — parsed and checked within the same bounds
before anything is stored: at most MAX_BYTES, objects and arrays at most MAX_DEPTH inside one
another (deeper, the parser and the encoders recurse until Python gives up), finite numbers
only (NaN, Infinity and 1e400 are not JSON a column stores), and no text (keys too) with a NUL
character (PostgreSQL refuses U+0000) or a lone surrogate (not UTF-8).

Each caller says what the JSON is ("the body", "the decision") and turns ``Refused`` into its
own answer: the API a 400 with ``fields``, the console and the commands an InvalidTransition.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_BYTES = 256 * 1024
MAX_DEPTH = 32  # objects and arrays inside one another: an event, not a stress test for the encoders


class Refused(ValueError):
    """JSON that may not be stored; ``fields`` names the offending value's path, when there is one."""

    def __init__(self, message: str, *, fields: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.fields = fields


def loads(text: str | bytes, *, what: str) -> Any:
    """``text`` parsed, or Refused: ``{what} is not valid JSON: …``."""
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise Refused(f"{what} is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, a constant, a number out of range, bytes not UTF-8
        raise Refused(f"{what} is not valid JSON: {exc}") from None


def check_size(text: str | bytes, *, what: str) -> None:
    size = len(text) if isinstance(text, bytes) else len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_BYTES:
        raise Refused(f"{what} is larger than {MAX_BYTES // 1024} KiB")


def check_storable(data: Any, *, what: str) -> None:
    """Refuse, with the path of the value, what parses as JSON but cannot be stored or shown:
    nesting deeper than MAX_DEPTH, and text (keys too) with a NUL character or a lone surrogate
    such as ``"\\ud800"``. Iterative: a value nested however deep is refused, not recursed into."""
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise Refused(f"{what} is nested deeper than {MAX_DEPTH} levels (at {path[:200] or 'the top'})")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, f"{path}.{key}" if path else key, what="key")
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, path, what="value")


def _check_text(text: str, path: str, *, what: str) -> None:
    where = path[:200] or "the top"  # JSON escapes the rest
    if "\x00" in text:
        raise Refused(f"the {what} at {where} contains a NUL character (U+0000)", fields={where: "NUL character"})
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise Refused(
            f"the {what} at {where} contains a lone surrogate (not UTF-8)", fields={where: "lone surrogate"}
        ) from None


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses as infinity, which no JSON column stores
        raise ValueError(f"the number {text[:40]} is out of range")
    return value
