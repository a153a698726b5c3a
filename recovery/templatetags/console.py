"""Template filters of the console."""

import json

from django import template

register = template.Library()


@register.filter
def pretty_json(value) -> str:
    """JSON as a person reads it: indented, keys sorted, non-ASCII kept (escaped by the template)."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)
