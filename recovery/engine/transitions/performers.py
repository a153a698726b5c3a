"""Which transition performs each operator action, and when the action is offered.

Each operator transition names the actions it performs (recovery.actions) with ``@performs``,
beside its body: the rule that says whether the action is valid on a run now (``offered``,
from recovery.engine.transitions.offers) and the arguments it is always called with. ``perform``
and ``offers.why_not`` read this table; nothing finds a transition by its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from recovery.actions import ACTIONS
from recovery.errors import InvalidTransition

# A rule: (situation, step name or None, actor or None) -> "" if valid now, else the refusal
# (its message, or the InvalidTransition to raise).
Rule = Callable[[Any, str | None, Any], "str | InvalidTransition"]


@dataclass(frozen=True)
class Performer:
    action: str
    transition: Callable[..., Any]
    offered: Rule
    options: dict[str, Any] = field(default_factory=dict)  # fixed arguments of the transition


PERFORMERS: dict[str, Performer] = {}


def performs[F: Callable[..., Any]](action: str, *, offered: Rule, **options: Any) -> Callable[[F], F]:
    """Register the decorated transition as the one that performs ``action`` (a row of
    recovery.actions.ACTIONS), offered where ``offered`` finds it valid, called with
    ``options`` besides what the action takes."""

    def register(transition: F) -> F:
        if action not in ACTIONS:
            raise ImproperlyConfigured(f"{transition.__name__} performs {action!r}, which recovery.actions lacks")
        if action in PERFORMERS:
            raise ImproperlyConfigured(
                f"{action!r} is performed by {PERFORMERS[action].transition.__name__} already, "
                f"not also by {transition.__name__}"
            )
        PERFORMERS[action] = Performer(action, transition, offered, options)
        return transition

    return register


def performer(action: str) -> Performer:
    found = PERFORMERS.get(action)
    if found is None:
        raise InvalidTransition(f"unknown action {action!r}")
    return found


def check_complete() -> None:
    """Every action of recovery.actions has its transition (called once the transitions are
    imported: a row without a body fails at start, not at an operator's click)."""
    missing = [name for name in ACTIONS if name not in PERFORMERS]
    if missing:
        raise ImproperlyConfigured(f"no transition performs {', '.join(missing)}: decorate one with @performs")
