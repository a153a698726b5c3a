"""Every operator action, once: what it is called, who may do it, what it needs, what the
console's button says. The console's buttons and forms, bulk, ``manage.py recover``,
``manage.py approval`` and the four-eyes requests all read this table; the transition that
performs an action names it with ``@performs`` (recovery.engine.transitions.performers), with
the rule that says where it is offered, and checks the run's state and the role again.

Plain data: nothing here imports the engine, so the engine, the workflow API and the console
can all read it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from recovery import jsoninput
from recovery.errors import InvalidTransition
from recovery.registry import version_number
from recovery.states import AuditAction


class Confirm(StrEnum):
    """When the console asks before it performs an action (recovery.recommend says what may be
    duplicated)."""

    NEVER = "never"
    ALWAYS = "always"  # it asserts absence, undoes effects, or stops the run for good
    IF_UNKNOWN = "if_unknown"  # it may send again a request whose first one may have landed


class StepArg(StrEnum):
    NONE = "none"  # the action is on the whole run
    OPTIONAL = "optional"  # compensate: the whole run, or one step
    REQUIRED = "required"


@dataclass(frozen=True)
class OperatorAction:
    name: str
    label: str  # how a request for it, and the console's four-eyes notice, name it
    permission: str  # its key in recovery.permissions.REQUIRED_ROLE (the lowest role allowed)
    step: StepArg = StepArg.NONE
    four_eyes: bool = False  # a workflow may put it behind a second supervisor (Workflow(four_eyes=…))
    bulk: bool = False  # the console's bulk form may apply it to many runs
    evidence: bool = False  # takes the remote id that shows the effect happened (--remote-ref)
    decision: bool = False  # takes an edited decision (JSON) for a model step
    duration: bool = False  # takes how long it lasts, in hours (--hours; its transition's default without)
    version: bool = False  # takes the workflow version to move the run to (--to-version), and --effects-stand
    waves: bool = False  # makes runs due: in bulk, they may be released in waves (transitions.waves)
    # takes a corrected input, or a corrected intent of its step (JSON: --input-file, --intent-file), and
    # --effects-stand (transitions.restarts)
    correction: bool = False
    # takes the sender's idempotency key (the API's): the same decision again under it is the first one
    keyed: bool = False
    # What it does and what it could send to another system, one sentence each ("{step}": its step),
    # as the run page says it beside the button and ``show_run`` beside the command line.
    does: str = ""
    sends: str = ""
    confirm: Confirm = Confirm.NEVER
    # The console's button and the question it asks before acting ("" for none), with {step}, and
    # for an agent's turn {agent} and {turn}, a refusal's {rule}, a compensation's {description};
    # an action whose step is optional names the whole run with button_run and ask_run.
    button: str = ""
    ask: str = ""
    button_run: str = ""
    ask_run: str = ""


ACTIONS: dict[str, OperatorAction] = {
    action.name: action
    for action in (
        OperatorAction(
            "resume",
            "resume",
            "resume",
            bulk=True,
            waves=True,
            does="goes on from the last checkpoint: steps that succeeded are kept, a blocked step gets a fresh "
            "retry budget and a held proposal is checked by the guards again",
            sends="a blocked step's request again under the same key (the receiver keeps its first result); "
            "an unknown outcome is looked up first",
            confirm=Confirm.IF_UNKNOWN,
            button="Resume from checkpoint",
        ),
        OperatorAction(
            "pause",
            "pause",
            "resume",
            bulk=True,
            does="no new attempt (nor compensation) starts until the run is unpaused: a call in flight finishes "
            "and is recorded, timers and in-flight windows keep running",
            sends="nothing",
            button="Pause",
        ),
        OperatorAction(
            "unpause",
            "unpause",
            "resume",
            bulk=True,
            waves=True,
            does="the run goes on where it stopped (forward, or compensating): due at once, or when its step's "
            "timer runs out",
            sends="the next step's request when its turn comes, under its own key",
            button="Unpause",
        ),
        OperatorAction(
            "retry",
            "retry",
            "retry",
            StepArg.REQUIRED,
            bulk=True,
            waves=True,
            does="tries {step} again now, with a fresh retry budget",
            sends="the same request again under the same key; the receiver keeps its first result",
            confirm=Confirm.IF_UNKNOWN,
            button="Retry {step}",
        ),
        OperatorAction(
            "retry_now",
            "retry now",
            "retry",
            StepArg.REQUIRED,
            does="makes {step}'s next attempt now instead of at the end of its backoff; its retry budget stays "
            "as it is (this attempt counts in it)",
            sends="{step}'s request again under the same key, once, now",
            button="Try {step} now, same budget",
        ),
        OperatorAction(
            "reset_attempts",
            "reset attempts",
            "reset_attempts",
            StepArg.REQUIRED,
            does="gives {step} its retry budget back: the attempts so far no longer count against it; its next "
            "attempt stays due when it was",
            sends="nothing now; {step}'s request again under the same key when its retry is due",
            button="Give {step} its retry budget back",
        ),
        OperatorAction(
            "reconcile",
            "reconcile",
            "reconcile",
            StepArg.REQUIRED,
            does="asks the receiver what became of {step} and records what it finds",
            sends="nothing: it looks {step} up by its key",
            button="Reconcile {step} by key",
        ),
        OperatorAction(
            "resolve_happened",
            "mark succeeded",
            "reconcile",
            StepArg.REQUIRED,
            four_eyes=True,
            evidence=True,
            does="asks the receiver for the remote id you give and, if it is {step}'s own, records {step} as "
            "succeeded with what the receiver answers; the run goes on",
            sends="nothing: it only reads the object by its id; the next steps run as usual",
            button="{step}: it succeeded",
        ),
        OperatorAction(
            "resolve_absent",
            "mark not happened",
            "reconcile",
            StepArg.REQUIRED,
            does="records that {step} did not happen: it becomes due again",
            sends="{step}'s request again under the same key: its effect happens a second time if the first "
            "request landed after the receiver was asked",
            confirm=Confirm.ALWAYS,
            button="{step}: it did not happen",
        ),
        OperatorAction(
            "compensate",
            "compensate",
            "compensate",
            StepArg.OPTIONAL,
            four_eyes=True,
            does="undoes {what} with the declared compensations, latest first",
            sends="each compensation's request (a cancellation, a refund) under its own key",
            confirm=Confirm.ALWAYS,
            button="Compensate {step}",
            ask="Undo {step}: {description}",
            button_run="Compensate the whole run",
            ask_run="Undo every completed effect of this run?",
        ),
        OperatorAction(
            "terminate",
            "terminate",
            "terminate",
            four_eyes=True,
            bulk=True,
            does="stops the run for good; effects already made stay made",
            sends="nothing",
            confirm=Confirm.ALWAYS,
            button="Terminate",
            ask="Stop this run for good? Effects made stay made.",
        ),
        OperatorAction(
            "supersede",
            "change the decision",
            "supersede",
            StepArg.REQUIRED,
            decision=True,
            does="replaces the model's decision for {step} with the one you write (checked against its schema "
            "and the guards), and the run goes on",
            sends="nothing now; the next steps send what the new decision says",
        ),
        OperatorAction(
            "decide_again",
            "ask the model again",
            "supersede",
            StepArg.REQUIRED,
            does="asks the model again for {step}'s decision",
            sends="a new request to the model only",
        ),
        OperatorAction(
            "override",
            "accept the refused proposal",
            "override",
            StepArg.REQUIRED,
            does="lets {step} act on the proposal the guard refused, for this run only",
            sends="{step}'s request as proposed",
            button="{step}: accept the refused proposal ({rule})",
            ask="Override {rule} for this run and let {step} act on the proposal as it is?",
        ),
        OperatorAction(
            "snooze_alert",
            "snooze its alert",
            "snooze",
            duration=True,
            does="silences the run's alert for a while; the run itself does not change",
            sends="nothing",
            button="Snooze its alert",
        ),
        OperatorAction(
            "stop_agent",
            "stop the agent",
            "stop_agent",
            StepArg.REQUIRED,
            does="stops the agent {step}: nothing more is asked of the model",
            sends="nothing more",
            button="Stop the agent {step}",
            ask="Stop {step} now? Nothing more is asked of the model or sent until an operator lets it go on.",
        ),
        OperatorAction(
            "fork_agent",
            "fork the agent from this turn",
            "fork_agent",
            StepArg.REQUIRED,
            does="asks the model again from before turn {step}; calls already made stay made",
            sends="later tool calls under a new key version",
            button="Fork {agent} from turn {turn}",
            ask="Ask the model again from before turn {turn}? Calls already made stay made "
            "(compensate them explicitly); later calls get a new key version.",
        ),
        # a tool call waiting for a person's approval (recovery.waiting.ToolApproval): the tool's
        # approver role is checked too (transitions.call_approvals); the console's Approvals panel
        OperatorAction(
            "approve_call",
            "approve the tool call",
            "decide_call",
            StepArg.REQUIRED,
            keyed=True,
            does="lets the agent's call {step} go as the model asked it; its guards check it again first",
            sends="{step}'s request, under its own key",
        ),
        OperatorAction(
            "edit_call",
            "edit and approve the tool call",
            "decide_call",
            StepArg.REQUIRED,
            keyed=True,
            decision=True,
            does="replaces {step}'s arguments with yours (checked against the tool's schema, the change kept in "
            "the audit trail) and lets it go; its guards check them first",
            sends="{step}'s request with your arguments, under its own key",
        ),
        OperatorAction(
            "reject_call",
            "reject the tool call",
            "decide_call",
            StepArg.REQUIRED,
            keyed=True,
            does="answers {step} to the model as refused, with your reason as the message; the agent goes on",
            sends="nothing for {step}; the model is asked its next turn",
        ),
        OperatorAction(
            "answer_call",
            "answer in place of the tool",
            "decide_call",
            StepArg.REQUIRED,
            keyed=True,
            decision=True,
            does="gives the model your answer (a JSON object) as {step}'s result; the tool is not called",
            sends="nothing for {step}; the model is asked its next turn",
        ),
        OperatorAction(
            "take",
            "take it",
            "take",
            StepArg.REQUIRED,
            does="assigns {step} to you in the inbox, for everyone to see; anyone with its role may still decide it",
            sends="nothing",
            button="I take {step}",
        ),
        OperatorAction(
            "move_version",
            "move to another version",
            "move_version",
            four_eyes=True,
            bulk=True,
            version=True,
            does="moves the run to the version you choose: the steps it began keep their keys and outcomes",
            sends="nothing now; the rest of the run follows that version",
            button="Move to another version",
            ask="Move this run to the chosen version? The steps it began keep their keys and outcomes; "
            "the rest follow that version's definition.",
        ),
        OperatorAction(
            "restart",
            "restart from a step with a corrected input",
            "restart",
            StepArg.REQUIRED,
            four_eyes=True,
            correction=True,
            does="makes every step from {step} on again with the corrected input (or {step}'s corrected intent): "
            "an effect made already is undone first, or stands beside a second one where the workflow says so; "
            "the difference and each effect's fate are shown before you confirm",
            sends="each effect from {step} on again, under a new key; compensations first where effects are undone",
            confirm=Confirm.ALWAYS,
        ),
    )
}


def audited(name: str) -> bool:
    """Whether an audit event may carry ``name``: the engine's (recovery.states.AuditAction) and
    each operator action's own (a transition audits under it unless it names an AuditAction)."""
    return name in AuditAction.values or name in ACTIONS


def audit_label(name: str) -> str:
    """An audited action as an operator reads it ("mark not happened" for ``resolve_absent``,
    "attempt failed" for ``step_fail``); a name no longer written, in words."""
    if name in AuditAction.values:
        return AuditAction(name).label
    action = ACTIONS.get(name)
    return action.label if action else str(name).replace("_", " ")


# A held tool call's decisions (recovery.engine.transitions.call_approvals): action -> the decision
# recorded on the call (and the outcome of its time to decision, recovery_wait_seconds).
CALL_DECISIONS = {"approve_call": "approve", "edit_call": "edit", "reject_call": "reject", "answer_call": "answer"}
FOUR_EYES_ACTIONS = frozenset(name for name, action in ACTIONS.items() if action.four_eyes)
BULK_ACTIONS = tuple(name for name, action in ACTIONS.items() if action.bulk)

# Deciding a four-eyes request: a supervisor (to approve, another one than the requester).
DECISIONS = {"approve": "approve", "reject": "approve"}

# action or decision -> the permission it needs
PERMISSION_OF = {**{name: action.permission for name, action in ACTIONS.items()}, **DECISIONS}


# The one action the console recommends for a run stuck for each cause (recovery.counts.
# stuck_causes), in order of preference: the first one the run's state allows now is recommended
# (recovery.recommend), the others stay under "more actions". A run stuck for several causes is
# judged by the first of them in this table's order (the most specific first, "needs review" last).
# A cause whose actions the run's state does not allow names what to do instead (NO_RUN_ACTION);
# ALERT_FIRING: a run stuck for no cause any more whose alert still fires. FAILED: a run that
# failed with nothing written elsewhere (not a stuck cause: nothing is wrong with what exists).
ALERT_FIRING = "alert_firing"
FAILED = "failed"
NOT_STUCK_LABELS = {ALERT_FIRING: "Alert firing", FAILED: "Failed, nothing written elsewhere"}
RECOMMENDED: dict[str, tuple[str, ...]] = {
    "approval": (),
    "no_executor": (),
    "version_not_deployed": ("move_version",),
    "agent_stopped": ("resume", "fork_agent"),
    "unknown": ("reconcile",),
    "lease_expired": ("reconcile",),
    "exhausted": ("retry",),
    "policy_refused": ("supersede", "override"),
    "model_output": ("supersede", "decide_again", "retry"),
    "failed_with_effects": ("compensate",),
    "compensation_failed": ("compensate", "terminate"),
    "message_undelivered": ("resume",),
    "needs_review": ("resume",),
    FAILED: ("retry", "resume", "terminate"),
    ALERT_FIRING: ("snooze_alert",),
}
NO_RUN_ACTION = {
    "approval": "a person of the role it names decides: the tool call under Approvals below, or the four-eyes "
    "request; nothing else is needed",
    "lease_expired": "another executor takes the run over once its lease is past: start one if none runs",
    "no_executor": "start an executor (manage.py run_executor): no action on the run is needed, it goes on "
    "once one runs",
    "version_not_deployed": "deploy the run's version again: this deployment has no other version to move it to",
}

# What reconciling an unknown step sends, by how the step declares it is reconciled (contract.Reconcile).
RECONCILE_SENDS = {
    "lookup": "nothing: it looks {step} up by its key",
    "resend": "{step}'s request again under the same key; the receiver keeps its first result",
    "rerun": "nothing elsewhere: {step} is run again (it has no external effect)",
}


def command_line(
    name: str, workflow_id: str, *, step: str | None = None, username: str = "<you>", to_version: int | None = None
) -> str:
    """The ``manage.py recover …`` equivalent of the console's action ``name`` (the same
    transition, the same checks), with placeholders for what the operator types: ``<reason>``,
    ``<remote id>``, ``<decision.json>``, ``<version>``."""
    spec = ACTIONS[name]
    parts = ["manage.py", "recover", name, workflow_id]
    if step:
        parts += ["--step", step]
    if spec.evidence:
        parts += ["--remote-ref", "<remote id>"]
    if spec.decision:
        parts += ["--decision-file", "<decision.json>"]
    if spec.duration:
        parts += ["--hours", f"{SNOOZE_DEFAULT_HOURS}"]
    if spec.version:
        parts += ["--to-version", f"{to_version}" if to_version is not None else "<version>"]
    if spec.correction:
        parts += ["--input-file", "<input.json>"]
    return shlex.join([*parts, "--reason", "<reason>", "--as", username])


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
    return parse_object(text, "the decision")


def parse_object(text: str, what: str) -> dict[str, Any]:
    """``what`` (a decision, a step's result) as a person typed it: a JSON object within the
    bounds of an event on the API (recovery.jsoninput: size, depth, finite numbers, no NUL), or
    InvalidTransition saying what is wrong with it."""
    try:
        jsoninput.check_size(text, what=what)
        value = jsoninput.loads(text, what=what)
        if not isinstance(value, dict):
            raise InvalidTransition(f"{what} must be a JSON object")
        jsoninput.check_storable(value, what=what)
    except jsoninput.Refused as exc:
        raise InvalidTransition(str(exc)) from None
    return value
