"""Template filters of the console."""

import json

from django import template

from recovery.actions import audit_label

register = template.Library()


@register.filter
def pretty_json(value) -> str:
    """JSON as a person reads it: indented, keys sorted, non-ASCII kept (escaped by the template)."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


@register.filter
def error_lines(text) -> dict:
    """An error as the console shows it: its first line, and the lines after it (a validation
    error's problems, one a line) to fold beneath — every one of them, never cut."""
    head, _, rest = str(text or "").partition("\n")
    return {"head": head, "more": [line.removeprefix("- ") for line in rest.split("\n") if line.strip()]}


@register.filter
def action_label(name) -> str:
    """An audited action as an operator reads it (recovery.actions.audit_label)."""
    return audit_label(str(name))
