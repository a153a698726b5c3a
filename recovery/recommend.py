"""The one action recommended for a stuck run: why it is stuck (its causes, exactly as the runs
list's stuck chips count them: recovery.counts.stuck_causes), which action fixes that cause
(recovery.actions.RECOMMENDED), what it will do and could send, whether it asks before it acts,
and its ``manage.py recover`` command line. The run page and ``manage.py show_run`` read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth.models import AbstractBaseUser

from recovery import counts, permissions
from recovery.actions import (
    ACTIONS,
    ALERT_FIRING,
    FAILED,
    NO_RUN_ACTION,
    NOT_STUCK_LABELS,
    RECOMMENDED,
    RECONCILE_SENDS,
    Confirm,
    StepArg,
    command_line,
)
from recovery.engine import transitions
from recovery.models import RunState, StepState, WorkflowRun


@dataclass(frozen=True)
class Recommendation:
    cause: str  # a key of stuck_causes, or ALERT_FIRING
    cause_label: str
    action: str | None  # None: nothing to do on the run (``instead`` says what)
    step: str | None = None
    label: str = ""  # the action's label (recovery.actions)
    does: str = ""
    sends: str = ""
    permitted: bool = True  # this person may do it (else ``who`` says who can)
    who: str = ""  # "a supervisor can change the decision"
    instead: str = ""
    command: str = ""


def causes_of(run: WorkflowRun, now: datetime) -> list[str]:
    """The stuck causes of one run, in RECOMMENDED's order: each cause's own condition applied to
    this run, all in one statement."""
    causes = counts.stuck_causes(now)
    runs = WorkflowRun.objects.filter(pk=run.pk)
    found = counts.capped_counts([runs.filter(condition) for _, condition in causes.values()])
    stuck = [cause for cause, (n, _) in zip(causes, found, strict=True) if n]
    order = list(RECOMMENDED)
    return sorted(stuck, key=lambda c: order.index(c) if c in order else len(order))


def recommend(
    situation: transitions.Situation,
    actor: AbstractBaseUser | None,
    causes: list[str],
    *,
    offered: list[tuple[str, str | None]] | None = None,
    username: str | None = None,
) -> Recommendation | None:
    """The recommended action for a run stuck for ``causes`` (``causes_of``), or None when it is
    not stuck. It is one the run's state allows now (transitions.offered); whether ``actor`` may
    do it is ``offered`` (their pairs), else ``who`` names the role that can."""
    valid = transitions.offered(situation, None)
    mine = transitions.offered(situation, actor) if offered is None else offered
    if not causes and situation.run.state == RunState.FAILED:
        causes = [FAILED]  # a failed step to retry once its cause is fixed, or a run to terminate
    if not causes and situation.firing_alert:
        causes = [ALERT_FIRING]
    username = username or (actor.get_username() if actor is not None else "<you>")
    for cause in causes:
        label = counts.STUCK_LABELS.get(cause) or NOT_STUCK_LABELS[cause]
        for name in RECOMMENDED.get(cause, ()):
            step = _step_for(cause, name, situation, valid)
            if step is False:
                continue
            permitted = (name, step) in mine
            return Recommendation(
                cause=cause,
                cause_label=label,
                action=name,
                step=step,
                label=ACTIONS[name].label,
                does=does(name, step),
                sends=sends(name, situation, step),
                permitted=permitted,
                who="" if permitted else _who(name, step, actor),
                command=command_line(name, situation.run.workflow_id, step=step, username=username),
            )
        if cause in NO_RUN_ACTION:
            return Recommendation(cause=cause, cause_label=label, action=None, instead=NO_RUN_ACTION[cause])
    return None


def _step_for(cause: str, name: str, situation: transitions.Situation, valid: list) -> str | None | bool:
    """The step the action is recommended on (None: the run), False when not valid now: the
    step the cause is about where the action is valid on it (an unknown outcome on X: reconcile
    X), else the first one it is valid on (a decision to change is on the model step, not on the
    step its proposal was refused at)."""
    steps = [step for action, step in valid if action == name]
    if not steps:
        return False
    if ACTIONS[name].step != StepArg.REQUIRED and None in steps:
        return None
    about = _cause_step(cause, situation)
    return about if about in steps else steps[0]


def _cause_step(cause: str, s: transitions.Situation) -> str | None:
    def first(test) -> str | None:
        return next((step.step_name for step in s.steps if test(step)), None)

    if cause in ("unknown", "lease_expired"):
        return first(lambda step: s.state_of(step) == StepState.UNKNOWN)
    if cause in ("exhausted", "model_output", FAILED):
        return first(lambda step: step.state == StepState.FAILED)
    if cause in ("policy_refused", "agent_stopped"):
        return first(lambda step: bool(step.refusal) and step.state != StepState.SKIPPED)
    return None


def does(name: str, step: str | None) -> str:
    return _fill(ACTIONS[name].does, step)


def sends(name: str, situation: transitions.Situation, step: str | None) -> str:
    """What the action could send: for a reconcile, as the step declares it is reconciled."""
    text = ACTIONS[name].sends
    if name == "reconcile" and step and situation.workflow is not None:
        reconcile = situation.workflow.get_step(step).reconcile
        text = RECONCILE_SENDS.get(str(reconcile), text)
    return _fill(text, step)


def confirmation(name: str, situation: transitions.Situation, step: str | None) -> str:
    """What the console asks before an action that asserts absence or may send a request again
    ("" for one it does not ask about here): it says what may be duplicated."""
    spec = ACTIONS[name]
    if spec.confirm == Confirm.NEVER:
        return ""
    if name == "resolve_absent":
        return (
            f"Declare that {step} did not happen? It becomes due and its request is sent again under the same "
            f"key: {_effect(situation, step)} may happen a second time if the first request landed after the receiver "
            "was asked."
        )
    unknown = situation.unknown()
    if spec.confirm == Confirm.IF_UNKNOWN:
        at = [step] if step in unknown else ([] if step else unknown)
        if not at:
            return ""
        what = " and ".join(_effect(situation, s) for s in at)
        verb = "Retry" if name == "retry" else "Resume"
        return (
            f"{verb} with the outcome of {', '.join(at)} unknown? It is looked up first; where the receiver cannot "
            f"say, its request is sent again under the same key and {what} may happen a second time if the first "
            "request landed after we looked."
        )
    return ""


def _effect(situation: transitions.Situation, step: str | None) -> str:
    """A step's effect as the confirmation names it: as the step declares it ("a new task in
    the tracker"), else its name."""
    try:
        effect = situation.workflow.get_step(step).effect
    except (AttributeError, LookupError):
        effect = ""
    if effect and effect != "none":
        return f"{effect} ({step})"
    return f"the effect of {step}"


def _who(name: str, step: str | None, actor: AbstractBaseUser | None) -> str:
    """Who can do what this person may not: the action's lowest role, or (their role reaches it
    but a compensation names a higher one) a supervisor."""
    spec = ACTIONS[name]
    needed = permissions.REQUIRED_ROLE[spec.permission]
    if permissions.role_of(actor) >= needed:
        needed = permissions.Role.SUPERVISOR
    role = needed.name.lower()
    article = "an" if role[0] in "aeiou" else "a"
    on = f" {step}" if step and name != "fork_agent" else ""
    return f"{article} {role} can {spec.label}{on}"


def _fill(text: str, step: str | None) -> str:
    what = step or "every completed effect of the run"
    return text.replace("{what}", what).replace("{step}", step or "the step")


def for_run(run: WorkflowRun, now: datetime) -> Recommendation | None:
    """The recommendation for one run as ``manage.py show_run`` prints it: for anyone (the
    command line names ``--as <you>``)."""
    situation = transitions.Situation.of(run, run.steps.all(), now)
    return recommend(situation, None, causes_of(run, now), username="<you>")


def said(advice: Recommendation) -> str:
    """One line: "unknown outcome: reconcile notify — looks … ; sends …"."""
    if advice.action is None:
        return f"{advice.cause_label.lower()}: {advice.instead}"
    on = f" {advice.step}" if advice.step else ""
    return f"{advice.cause_label.lower()}: {advice.label}{on}; it {advice.does}; sends {advice.sends}"
