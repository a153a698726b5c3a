"""The run page's actions, arranged: the one recommended for the run's stuck cause first, with
what it will do and could send (recovery.recommend), the others under "More actions"; each with
its ``manage.py recover`` command line, and the question asked before one that asserts absence or
may send a request again."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser

from recovery import recommend
from recovery.actions import command_line
from recovery.console import services


def action_panel(
    detail: dict[str, Any], user: AbstractBaseUser, *, now: datetime, pairs: list | None = None
) -> dict[str, Any]:
    """``actions``: the buttons, the recommended one first; ``advice``: the recommendation (its
    cause, what it does and sends, or who can do it, or what to do instead), None for a run that
    is not stuck."""
    pairs = services.offered(detail, user, now=now) if pairs is None else pairs
    situation = services._situation(detail, now)
    causes = recommend.causes_of(detail["run"], now)
    advice = recommend.recommend(situation, user, causes, offered=pairs)
    actions = [
        _described(a, situation, detail["run"].workflow_id, user, advice)
        for a in services.available_actions(detail, user, now=now, pairs=pairs)
    ]
    actions.sort(key=lambda a: not a.recommended)
    return {"actions": actions, "advice": advice, "more": sum(not a.recommended for a in actions)}


def _described(action, situation, workflow_id: str, user, advice) -> services.Action:
    step = action.step or None
    chosen = next((v for v, _, picked in action.versions if picked), None)
    asked = recommend.confirmation(action.name, situation, step)
    return replace(
        action,
        does=recommend.does(action.name, step),
        sends=recommend.sends(action.name, situation, step),
        command=command_line(action.name, workflow_id, step=step, username=user.get_username(), to_version=chosen),
        confirm=action.confirm or asked,
        recommended=advice is not None and advice.permitted and (advice.action, advice.step) == (action.name, step),
    )


def question(detail: dict[str, Any], user: AbstractBaseUser, *, now: datetime, action: str, step: str | None) -> str:
    """What the page asks before ``action`` on ``step`` ("" when it asks nothing): the same
    question the button's dialog asks, for a form posted without JavaScript."""
    found = action_panel(detail, user, now=now)["actions"]
    return next((a.confirm for a in found if (a.name, a.step or None) == (action, step or None)), "")
