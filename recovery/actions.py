"""Every operator action, once: what it is called, who may do it, what it needs, and which
transition performs it. The console's buttons and forms, bulk, ``manage.py recover``,
``manage.py approval`` and the four-eyes requests all read this table; the transition
(``recovery.engine.transitions.perform``) checks the run's state and the role again.

Plain data: nothing here imports the engine, so the engine, the workflow API and the console
can all read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from recovery.errors import InvalidTransition
from recovery.registry import version_number


class StepArg(StrEnum):
    NONE = "none"  # the action is on the whole run
    OPTIONAL = "optional"  # compensate: the whole run, or one step
    REQUIRED = "required"


@dataclass(frozen=True)
class OperatorAction:
    name: str
    label: str  # how a request for it, and the console's four-eyes notice, name it
    permission: str  # its key in recovery.permissions.REQUIRED_ROLE (the lowest role allowed)
    transition: str  # the function of recovery.engine.transitions that performs it
    step: StepArg = StepArg.NONE
    four_eyes: bool = False  # a workflow may put it behind a second supervisor (Workflow(four_eyes=…))
    bulk: bool = False  # the console's bulk form may apply it to many runs
    evidence: bool = False  # takes the remote id that shows the effect happened (--remote-ref)
    decision: bool = False  # takes an edited decision (JSON) for a model step
    duration: bool = False  # takes how long it lasts, in hours (--hours; its transition's default without)
    version: bool = False  # takes the workflow version to move the run to (--to-version), and --effects-stand
    options: dict[str, Any] = field(default_factory=dict)  # fixed arguments of the transition


ACTIONS: dict[str, OperatorAction] = {
    action.name: action
    for action in (
        OperatorAction("resume", "resume", "resume", "run_resume", bulk=True),
        OperatorAction("retry", "retry", "retry", "step_retry", StepArg.REQUIRED, bulk=True),
        OperatorAction("reconcile", "reconcile", "reconcile", "step_reconcile", StepArg.REQUIRED),
        OperatorAction(
            "resolve_happened",
            "mark succeeded",
            "reconcile",
            "step_resolve",
            StepArg.REQUIRED,
            four_eyes=True,
            evidence=True,
            options={"happened": True},
        ),
        OperatorAction(
            "resolve_absent",
            "mark not happened",
            "reconcile",
            "step_resolve",
            StepArg.REQUIRED,
            options={"happened": False},
        ),
        OperatorAction("compensate", "compensate", "compensate", "run_compensate", StepArg.OPTIONAL, four_eyes=True),
        OperatorAction("terminate", "terminate", "terminate", "run_terminate", four_eyes=True, bulk=True),
        OperatorAction(
            "supersede", "change the decision", "supersede", "decision_supersede", StepArg.REQUIRED, decision=True
        ),
        OperatorAction("decide_again", "ask the model again", "supersede", "decision_supersede", StepArg.REQUIRED),
        OperatorAction("override", "accept the refused proposal", "override", "step_override", StepArg.REQUIRED),
        OperatorAction("snooze_alert", "snooze its alert", "snooze", "alert_snooze", duration=True),
        OperatorAction("stop_agent", "stop the agent", "stop_agent", "agent_stop", StepArg.REQUIRED),
        OperatorAction("fork_agent", "fork the agent from this turn", "fork_agent", "agent_fork", StepArg.REQUIRED),
        OperatorAction(
            "move_version",
            "move to another version",
            "move_version",
            "run_move_version",
            four_eyes=True,
            bulk=True,
            version=True,
        ),
    )
}

FOUR_EYES_ACTIONS = frozenset(name for name, action in ACTIONS.items() if action.four_eyes)
BULK_ACTIONS = tuple(name for name, action in ACTIONS.items() if action.bulk)

# Deciding a four-eyes request: a supervisor (to approve, another one than the requester).
DECISIONS = {"approve": "approve", "reject": "approve"}

# action or decision -> the permission it needs
PERMISSION_OF = {**{name: action.permission for name, action in ACTIONS.items()}, **DECISIONS}


# How long a snooze may last: the console's choices (24 h unless another is chosen) and the most
# any surface accepts. A longer silence is a decision about the workflow (its stuck_after), not a click.
SNOOZE_CHOICES = ((1, "1 h"), (4, "4 h"), (8, "8 h"), (24, "24 h"), (72, "3 days"), (168, "a week"))
SNOOZE_DEFAULT_HOURS = 24
MAX_SNOOZE_HOURS = 168


def parse_hours(text: str | None) -> float | None:
    """A duration in hours as the form or ``recover --hours`` gives it (None when not given);
    the transition checks its range."""
    if text is None or not text.strip():
        return None
    try:
        return float(text)
    except ValueError:
        raise InvalidTransition(f"give the duration in hours as a number, not {text.strip()[:40]!r}") from None


def parse_version(text: str | None) -> int | None:
    """A workflow version as the form or ``recover --to-version`` gives it (None when not given)."""
    if text is None or not str(text).strip():
        return None
    text = str(text).strip().removeprefix("v")
    version = version_number(text)
    if version is None:
        raise InvalidTransition(f"give the version as a whole number, not {text[:20]!r}")
    return version


def parse_decision(text: str | None) -> dict[str, Any]:
    """An edited decision as the form or ``recover --decision`` gives it: a JSON object."""
    if not (text or "").strip():
        raise InvalidTransition("give the new decision as a JSON object")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidTransition(f"the decision is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidTransition("the decision must be a JSON object")
    return value
