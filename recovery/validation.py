"""A model step's schema as an operator meets it: a validation error as the list of its
problems (every one, bounded), and the schema's fields with an example to start a decision
written by hand from.

The problem list is what the engine stores for an invalid model output (the step's
``last_error``, the invalid decision's ``validation_error``) and what a refused hand-written
decision says: a first line naming the schema and how many problems, then one line per problem.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pydantic

# At most this many problems are stored, each line at most this long: the whole list stays
# within the step's error column (4,000 characters) with room for the first line.
MAX_PROBLEMS = 20
MAX_PROBLEM_CHARS = 160
_GIVEN_CHARS = 60

_COUNT = re.compile(r": (\d+) problems?$")


def problems_of(exc: pydantic.ValidationError | ValueError) -> list[str]:
    """One line per problem: where (the field's path), what is wrong, and what was given
    (except for a missing field, where the whole input would be repeated)."""
    if not isinstance(exc, pydantic.ValidationError):
        return [f"not JSON: {exc}"]
    lines = []
    for error in exc.errors(include_url=False):
        where = ".".join(map(str, error["loc"])) or "(the whole output)"
        given = "" if error["type"] == "missing" else f" (given: {_given(error.get('input'))})"
        lines.append(f"{where}: {error['msg']}{given}")
    return lines


def _given(value: Any) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= _GIVEN_CHARS else text[: _GIVEN_CHARS - 1] + "…"


def problem_text(headline: str, problems: list[str]) -> str:
    """``headline: N problems`` then ``- problem`` per line, at most MAX_PROBLEMS of them, each
    cut at MAX_PROBLEM_CHARS, and ``- … and N more`` when the list was cut."""
    count = len(problems)
    lines = [f"{headline}: {count} problem{'' if count == 1 else 's'}"]
    for problem in problems[:MAX_PROBLEMS]:
        line = f"- {problem}"
        lines.append(line if len(line) <= MAX_PROBLEM_CHARS else line[: MAX_PROBLEM_CHARS - 1] + "…")
    if count > MAX_PROBLEMS:
        lines.append(f"- … and {count - MAX_PROBLEMS} more")
    return "\n".join(lines)


def problem_count(text: str) -> int | None:
    """How many problems a stored validation error names (its first line), None if it names none."""
    match = _COUNT.search((text or "").split("\n", 1)[0])
    return int(match.group(1)) if match else None


def one_line(text: str) -> str:
    """A problem list on one line (a command's refusal, a flash message): ``headline: a; b``."""
    head, _, rest = (text or "").partition("\n")
    items = [line.removeprefix("- ") for line in rest.split("\n") if line]
    return f"{_COUNT.sub('', head)}: {'; '.join(items)}" if items else head


# --- the schema's fields, for a decision written by hand ----------------------------------


def fields_of(schema: type[pydantic.BaseModel]) -> list[dict[str, Any]]:
    """Each field of the schema: its name, its type in words (choices, bounds, pattern) and
    whether it is required, in the schema's order."""
    document = schema.model_json_schema()
    required = set(document.get("required", ()))
    return [
        {"name": name, "type": _type_text(prop), "required": name in required, "description": _describe(prop)}
        for name, prop in document.get("properties", {}).items()
    ]


def _describe(prop: dict[str, Any]) -> str:
    return str(prop.get("description", ""))


def _type_text(prop: dict[str, Any]) -> str:
    if "anyOf" in prop:
        return " or ".join(_type_text(option) for option in prop["anyOf"])
    if "enum" in prop:
        return "one of " + ", ".join(json.dumps(v, ensure_ascii=False) for v in prop["enum"])
    if "const" in prop:
        return json.dumps(prop["const"], ensure_ascii=False)
    text = str(prop.get("type", "any value"))
    bounds = [
        f"{word} {prop[key]}"
        for key, word in (
            ("minimum", "≥"),
            ("exclusiveMinimum", ">"),
            ("maximum", "≤"),
            ("exclusiveMaximum", "<"),
            ("minLength", "at least"),
            ("maxLength", "at most"),
        )
        if key in prop
    ]
    if "minLength" in prop or "maxLength" in prop:
        bounds = [b + " characters" if b.startswith("at ") else b for b in bounds]
    if "pattern" in prop:
        bounds.append(f"matching {prop['pattern']}")
    return f"{text} ({', '.join(bounds)})" if bounds else text


def example_of(schema: type[pydantic.BaseModel]) -> dict[str, Any]:
    """A JSON object with every field of the schema and a placeholder value of its type (a
    default where the schema has one, else the first choice, 0, "", false, [] or {})."""
    document = schema.model_json_schema()
    return {name: _example(prop) for name, prop in document.get("properties", {}).items()}


def _example(prop: dict[str, Any]) -> Any:
    if "default" in prop:
        return prop["default"]
    if "anyOf" in prop:
        return _example(prop["anyOf"][0])
    if prop.get("enum"):
        return prop["enum"][0]
    if "const" in prop:
        return prop["const"]
    return {"number": 0, "integer": 0, "boolean": False, "array": [], "object": {}, "null": None}.get(
        prop.get("type", ""), ""
    )


def skeleton(schema: type[pydantic.BaseModel], proposal: str | None) -> dict[str, Any]:
    """What a decision written by hand starts from: the model's last invalid proposal when it
    is a JSON object (its values kept, fields it lacks added with a placeholder), else the
    schema's example."""
    example = example_of(schema)
    try:
        given = json.loads(proposal) if proposal else None
    except (ValueError, RecursionError):  # a model's output nested too deep to parse is no start either
        given = None
    if not isinstance(given, dict):
        return example
    return {**example, **given}
