"""The run page's "Waiting for a person" section (issue 38): each tool call held for approval, with
its arguments, who may decide it, its deadline and what happens then, and the four decisions this
person may make now — approve, edit the arguments, reject (the reason is what the model reads),
answer in the tool's place — plus "I take this". Each form posts to the run's action endpoint:
the same transitions as ``manage.py recover`` and the decision API."""

from __future__ import annotations

import json
from typing import Any

from django.contrib.auth.models import AbstractBaseUser

from recovery import validation
from recovery.actions import CALL_DECISIONS
from recovery.engine import transitions
from recovery.waiting import a_role
from recovery.workflow import parse_journal_name

DECIDE = tuple(CALL_DECISIONS)
OWN_SECTION = (*DECIDE, "take")  # not among the generic buttons: this section has them


def call_forms(detail: dict[str, Any], user: AbstractBaseUser, pairs: list[tuple[str, str | None]]) -> list[dict]:
    """The calls this run holds for a person, each with what ``user`` may do to it now (``pairs``:
    the actions the transitions offer this user, ``services.offered``)."""
    workflow = detail["workflow"]
    if workflow is None:
        return []
    allowed: dict[str, set[str]] = {}
    for name, step in pairs:
        if name in OWN_SECTION and step:
            allowed.setdefault(step, set()).add(name)
    forms = []
    for step in detail["steps"]:
        if not transitions.awaits_decision(step):
            continue
        spec = workflow.get_step(step.step_name)
        if getattr(spec, "approval", None) is None:
            continue
        may = allowed.get(step.step_name, set())
        result = validation.skeleton(spec.result_schema, None) if spec.result_schema is not None else {}
        forms.append(
            {
                "step": step.step_name,
                "tool": parse_journal_name(step.step_name).tool,
                "arguments": json.dumps(step.intent or {}, indent=2, sort_keys=True),
                "role": step.approval.get("role", "supervisor"),
                "a_role": a_role(step.approval.get("role", "supervisor")),
                "escalated": bool(step.approval.get("escalated_at")),
                "assignee": step.approval.get("assignee", ""),
                "deadline": step.next_attempt_at,
                "timed_out": "timed_out_at" in step.approval,
                "then": spec.approval.on_timeout.text(),
                "answer": json.dumps(result, indent=2),
                "may": may,
                "decides": bool(may & set(DECIDE)),
            }
        )
    return forms


def with_takes(event_forms: list[dict], detail: dict[str, Any], pairs: list[tuple[str, str | None]]) -> list[dict]:
    """The Events section's forms, each with who took its wait step and whether this person may take it."""
    takable = {step for name, step in pairs if name == "take"}
    taken = {s.step_name: (s.approval or {}).get("assignee", "") for s in detail["steps"] if s.approval}
    return [{**f, "taken": taken.get(f["step"], ""), "takable": f["step"] in takable} for f in event_forms]
