"""What the console's views call: operator actions mapped onto the transition functions (the
same ones the executor and `manage.py recover` use), bulk actions, and the read model of the
dashboard."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser

from recovery import clock, registry, validation
from recovery.actions import (
    ACTIONS,
    BULK_ACTIONS,
    SNOOZE_CHOICES,
    SNOOZE_DEFAULT_HOURS,
    StepArg,
    parse_decision,
    parse_hours,
    parse_object,
    parse_version,
)
from recovery.console import bulk_facts, call_forms
from recovery.engine import evidence, transitions
from recovery.errors import ApprovalRequired, InvalidTransition
from recovery.models import (
    AlertState,
    DecisionState,
    ModelDecision,
    RunState,
    StepExecution,
    StepState,
    WorkflowRun,
)
from recovery.permissions import can


def apply_action(
    *,
    action: str,
    workflow_id: str,
    step: str | None,
    reason: str,
    expect: str | None,
    remote_ref: str,
    actor: AbstractBaseUser,
    request_id: str | None = None,
    decision: str | None = None,
    hours: str | None = None,
    to_version: str | None = None,
    effects_stand: bool = False,
    result: str | None = None,
    correction: tuple[str, str] | None = None,
) -> str:
    """Apply one operator action; returns the message to show. On a workflow with four-eyes
    actions, compensate, terminate and "it succeeded" become a request for approval, and
    ``approve``/``reject`` decide request ``request_id``. Raises InvalidTransition
    (RunChanged when the page was stale) and WorkflowRun.DoesNotExist."""
    common = {"workflow_id": workflow_id, "actor": actor, "reason": reason, "expect": expect}
    if action in ("approve", "reject"):
        return _decide(action, request_id, workflow_id=workflow_id, actor=actor, reason=reason, expect=expect)
    spec = ACTIONS.get(action)
    edited = parse_decision(decision) if spec and spec.decision else None
    duration = parse_hours(hours) if spec and spec.duration else None
    moving = {"version": parse_version(to_version), "effects_stand": effects_stand} if spec and spec.version else {}
    if spec and spec.correction:  # a restart (recovery.console.restart_views): what is corrected, as posted
        moving = {"correction": parse_correction(*(correction or ("", ""))), "effects_stand": effects_stand}
    transitions.require_reason(reason)  # before the receiver is asked for the evidence
    checked = evidence.examine(
        action, workflow_id=workflow_id, step_name=step, remote_ref=remote_ref, result=result, actor=actor
    )
    try:
        run = transitions.perform(
            action, step_name=step, evidence=checked, decision=edited, hours=duration, **moving, **common
        )
    except ApprovalRequired:
        # The workflow puts it behind four eyes: the same form asks for it instead.
        transitions.approval_request(action=action, step_name=step, evidence=checked, **moving, **common)
        label = transitions.LABELS[action]
        return f"{label} requested: another supervisor must approve it before it runs"
    target = f" ({step})" if step else ""
    label = ACTIONS[action].label if action in ACTIONS else action.replace("_", " ")
    return f"{label}{target} recorded; the run is now {RunState(run.state).label.lower()}"


def parse_correction(edit: str, text: str) -> tuple[str, dict[str, Any]]:
    """A restart's correction as a form posts it: what is corrected ("input" or "intent") and its
    JSON object (recovery.actions.parse_object: its bounds, a message for each problem)."""
    if edit not in ("input", "intent"):
        raise InvalidTransition("a restart corrects the run's input or the step's intent: choose one")
    return edit, parse_object(text or "", f"the corrected {edit}")


def restarts(run) -> list:
    """The run's restarts (its lineage), each with its difference as people read it."""
    found = list(run.restarts.all())
    for restart in found:
        restart.changes = [transitions.change_text(c) for c in restart.diff]
    return found


def _decide(
    action: str, request_id: str | None, *, workflow_id: str, actor: AbstractBaseUser, reason: str, expect: str | None
) -> str:
    request = transitions.approval_decide(
        action, request_id=request_id, workflow_id=workflow_id, actor=actor, reason=reason, expect=expect
    )
    label = transitions.LABELS[request.action]
    if action == "reject":
        return f"request to {label} turned down"
    return f"{label} approved and recorded; the run is now {RunState(request.run.state).label.lower()}"


@dataclass(frozen=True)
class Action:
    name: str
    label: str
    step: str = ""
    confirm: str = ""  # compensate and terminate ask before they act
    evidence: bool = False  # "it succeeded, remote id X"
    # how that evidence is checked (StepSpec.evidence_rule), and where the receiver cannot be asked
    # by id, the step's result to fill in: a JSON skeleton of its schema and the schema's fields
    evidence_rule: str = ""
    result_skeleton: str = ""
    result_fields: tuple = ()
    durations: tuple[tuple[int, str, bool], ...] = ()  # how long it may last (hours, label, chosen): a snooze
    # The versions a run may be moved to: (version, what a move there would do or why not, chosen)
    versions: tuple[tuple[int, str, bool], ...] = ()
    effects_question: bool = False  # a target rekeys a finished step: does its effect stand?
    # recovery.console.panel: what it does and could send, its `manage.py recover` line, and
    # whether it is the one recommended for the run's stuck cause (shown first, the rest folded)
    does: str = ""
    sends: str = ""
    command: str = ""
    recommended: bool = False


# Where the console shows each action: the decision tools sit with the model's decision, a
# restart has its page (recovery.console.restart_views), linked from the run page.
DECISION_TOOLS = ("supersede", "decide_again")
OWN_PAGES = (*DECISION_TOOLS, "restart", *call_forms.OWN_SECTION)


def offered(detail: dict[str, Any], user: AbstractBaseUser, *, now: datetime) -> list[tuple[str, str | None]]:
    """(action, step) pairs valid in the run's current state AND allowed for this user: the
    transitions' own judgement (transitions.why_not), which they apply again when the form
    comes back."""
    return transitions.offered(_situation(detail, now), user)


def beyond_role(detail: dict[str, Any], pairs: list[tuple[str, str | None]], *, now: datetime) -> list[str]:
    """What the run's state allows but this person's role does not (named, so that a page with
    no button says why): the labels of the valid actions outside ``pairs``."""
    valid = transitions.offered(_situation(detail, now), None)
    return list(dict.fromkeys(ACTIONS[name].label for name, step in valid if (name, step) not in pairs))


def _situation(detail: dict[str, Any], now: datetime) -> transitions.Situation:
    """The run page's run as the actions judge it, from what the page already read."""
    firing = any(alert.state == AlertState.FIRING for alert in detail["alerts"])
    return transitions.Situation.of(detail["run"], detail["steps"], now, firing_alert=firing)


def available_actions(
    detail: dict[str, Any], user: AbstractBaseUser, *, now: datetime, pairs: list | None = None
) -> list[Action]:
    """The run page's buttons (``pairs``: ``offered``, if already computed)."""
    pairs = offered(detail, user, now=now) if pairs is None else pairs
    workflow = detail["workflow"]
    steps = {s.step_name: s for s in detail["steps"]}
    actions = [_button(name, steps.get(step), workflow) for name, step in pairs if name not in OWN_PAGES]
    actions = [_with_targets(a, detail) if a.name == "move_version" else a for a in actions]
    four_eyes = workflow.four_eyes if workflow is not None else frozenset()
    return [_as_request(a) if a.name in four_eyes else a for a in actions]


def _with_targets(action: Action, detail: dict[str, Any]) -> Action:
    """The move's form: every other registered version of the run's workflow with what moving
    there would do (the transition's own judgement, versions.move_plan), the newest that can
    continue the run chosen; and the question whether effects stand, only where a target asks it."""
    run = detail["run"]
    decisions = {d.step_name: d for d in detail["decisions"] if d.state == DecisionState.ACCEPTED}
    plans = [
        transitions.move_plan(run, detail["steps"], target, decisions)
        for target in registry.all_versions()
        if target.name == run.workflow_name and target.version != run.workflow_version
    ]
    chosen = max((p.target for p in plans if p.ok), default=None)
    versions = tuple((p.target, p.summary(), p.target == chosen) for p in sorted(plans, key=lambda p: -p.target))
    return replace(action, versions=versions, effects_question=any(p.ok and p.effects for p in plans))


def _button(name: str, step: StepExecution | None, workflow) -> Action:
    """The action's button as the action table words it (recovery.actions: ``button``, ``ask``),
    filled in with this step's facts."""
    spec = ACTIONS[name]
    at = step.step_name if step is not None else ""
    label, ask = (spec.button_run, spec.ask_run) if step is None and spec.button_run else (spec.button, spec.ask)
    agent, _, turn = at.rpartition(":")
    facts = {"step": at, "agent": agent, "turn": turn}
    if "{rule}" in label + ask:
        facts["rule"] = step.refusal.get("rule", "")
    if "{description}" in label + ask:
        facts["description"] = workflow.get_step(at).compensation.description
    durations = tuple((h, text, h == SNOOZE_DEFAULT_HOURS) for h, text in SNOOZE_CHOICES) if spec.duration else ()
    action = Action(name, label.format(**facts), at, confirm=ask.format(**facts), durations=durations)
    return _with_evidence(action, workflow.get_step(at)) if spec.evidence else action


def _with_evidence(action: Action, spec) -> Action:
    """ "It succeeded": the remote id, looked up at the receiver; or, where the receiver cannot be
    asked by id, the step's result filled in (recovery.engine.evidence)."""
    if spec.lookup_ref_fn is not None or spec.result_schema is None:
        return replace(action, evidence=True, evidence_rule=spec.evidence_rule())
    skeleton = json.dumps(validation.skeleton(spec.result_schema, None), indent=2)
    fields = tuple(validation.fields_of(spec.result_schema))
    return replace(
        action, evidence=True, evidence_rule=spec.evidence_rule(), result_skeleton=skeleton, result_fields=fields
    )


def decision_tools(
    detail: dict[str, Any], user: AbstractBaseUser, *, now: datetime, pairs: list | None = None
) -> list[dict[str, Any]]:
    """The accepted decisions this user may replace now (edited, or asked of the model again),
    each with its JSON for the form; and the model steps whose output never validated, whose
    decision this user may write by hand: prefilled from the last invalid output (or the
    schema's example), with the schema's fields."""
    pairs = offered(detail, user, now=now) if pairs is None else pairs
    editable = {step for name, step in pairs if name == "supersede"}
    tools = [
        {"step": d.step_name, "json": json.dumps(d.accepted, indent=2, sort_keys=True)}
        for d in detail["accepted"]
        if d.step_name in editable
    ]
    last_invalid = {d.step_name: d for d in detail["invalid"]}  # oldest first: the last one wins
    for step in sorted(editable - {t["step"] for t in tools}):
        schema = detail["workflow"].get_step(step).decision_schema
        proposal = last_invalid[step].invalid_output if step in last_invalid else None
        skeleton = validation.skeleton(schema, proposal)
        tools.append({"step": step, "json": json.dumps(skeleton, indent=2), "fields": validation.fields_of(schema)})
    return tools


def _as_request(action: Action) -> Action:
    """On a four-eyes workflow, the action's button asks for it instead."""
    return replace(
        action,
        label=f"Request: {action.label}",
        confirm=f"{action.confirm or action.label + '?'} A second supervisor must approve it before it runs.",
    )


def four_eyes_labels(workflow) -> list[str]:
    """The workflow's actions that need a second supervisor, as the console names them."""
    if workflow is None:
        return []
    return [label for action, label in transitions.LABELS.items() if action in workflow.four_eyes]


def pending_approvals(run: WorkflowRun, workflow, user: AbstractBaseUser) -> list[dict[str, Any]]:
    """The run's requests waiting for a second supervisor, with what this user may do (no
    query for a workflow without four-eyes actions)."""
    if workflow is None or not workflow.four_eyes:
        return []
    pending = run.approvals.filter(state="pending").select_related("requested_by").order_by("requested_at", "pk")
    return [
        {
            "request": request,
            "label": transitions.LABELS.get(request.action, request.action),
            "can_approve": can(user, "approve") and request.requested_by_id != user.pk,
            "can_reject": can(user, "approve"),
            "own": request.requested_by_id == user.pk,
            "plan": _requested_restart(run, request),
        }
        for request in pending
    ]


def _requested_restart(run: WorkflowRun, request) -> list[str]:
    """What a requested restart would do now, as its requester saw it before asking (the
    difference, each effect's fate), for the supervisor who approves it; or why it no longer can."""
    if not ACTIONS[request.action].correction:
        return []
    edited, value = (request.options or {}).get("correction") or ("", None)
    situation = transitions.Situation.of(run, run.steps.all(), clock.now())
    try:
        effects_stand = bool((request.options or {}).get("effects_stand"))
        plan = transitions.restart_preview(
            situation, request.step_name, actor=None, edited=edited, value=value, effects_stand=effects_stand
        )
    except InvalidTransition as exc:
        return [f"it can no longer run as asked: {exc}"]
    return plan.lines()


# --- bulk ---------------------------------------------------------------------------

BULK_LIMIT = 500


@dataclass
class BulkResult:
    action: str
    done: list[str] = field(default_factory=list)  # applied (a dry run: would apply)
    refused: list[tuple[str, str]] = field(default_factory=list)
    applied: bool = True  # False for a dry run
    reason: str = ""
    version: int | None = None  # move_version: the version the runs move to
    waves: transitions.Waves = field(default_factory=transitions.Waves)  # resume, retry, unpause: when due
    notes: dict[str, str] = field(default_factory=dict)  # a dry run: what it would do to a run in ``done``
    facts: dict[str, Any] = field(default_factory=dict)  # a dry run: each run's bulk_facts.RunFacts

    @property
    def wave_text(self) -> str:
        """ "in 3 waves of 10, 60 s apart" """
        return self.waves.text(len(self.done))

    @property
    def wave_seconds(self) -> int:
        return int(self.waves.every.total_seconds())

    @property
    def selected(self) -> int:
        return len(self.done) + len(self.refused)

    @property
    def title(self) -> str:
        """The action as the page names it: "resume", "move to v2"."""
        return f"move to v{self.version}" if self.version is not None else self.action

    @property
    def listed(self) -> list[tuple[str, str, Any]]:
        """The runs in ``done``, each with its note ("" without) and its facts (None without)."""
        return [(w, self.notes.get(w, ""), self.facts.get(w)) for w in self.done]

    @property
    def refused_listed(self) -> list[tuple[str, str, Any]]:
        return [(w, why, self.facts.get(w)) for w, why in self.refused]


def bulk_choices(user: AbstractBaseUser) -> list[tuple[str, str]]:
    """The bulk form's actions (recovery.actions), those this user's role may do."""
    return [(name, ACTIONS[name].label.capitalize()) for name in BULK_ACTIONS if can(user, ACTIONS[name].permission)]


def bulk_targets(user: AbstractBaseUser) -> list[tuple[int, str]]:
    """The versions the bulk form may move runs to, for a user who may move them: every version
    number a registered workflow has, with the workflows that have it when not all of them do
    ("v1", "v2: invoice")."""
    if not can(user, ACTIONS["move_version"].permission):
        return []
    having: dict[int, list[str]] = {}
    for workflow in registry.all_versions():
        having.setdefault(workflow.version, []).append(workflow.name)
    everyone = len({name for names in having.values() for name in names})
    return [
        (v, f"v{v}" if len(names) == everyone else f"v{v}: {', '.join(names)}") for v, names in sorted(having.items())
    ]


@dataclass(frozen=True)
class BulkRequest:
    """A bulk action as checked (``bulk_selection``): what the dry run shows and the confirmation
    applies — the action, its reason, the runs, the version of a move, the waves of a release."""

    action: str
    reason: str
    workflow_ids: list[str]
    version: int | None = None
    waves: transitions.Waves = field(default_factory=transitions.Waves)


def bulk_selection(
    *,
    action: str,
    reason: str,
    workflow_ids: list[str],
    all_matching: bool,
    filters,
    to_version: str | None = None,
    wave_size: str | None = None,
    wave_seconds: str | None = None,
) -> BulkRequest:
    """The checked request of a bulk action: the run ids it is about, the version to move them
    to (None but for move_version), the waves to release them in. "All matching" becomes the
    list of ids it means now, so that what is confirmed is what was shown."""
    if action not in BULK_ACTIONS:
        raise ValueError(f"bulk action must be one of {', '.join(BULK_ACTIONS)}")
    try:
        reason = transitions.require_reason(reason)  # refused once, not once per run
        version = parse_version(to_version) if ACTIONS[action].version else None
        waves = transitions.Waves.parse(wave_size, wave_seconds)
    except InvalidTransition as exc:
        raise ValueError(str(exc)) from None
    if waves.size and not ACTIONS[action].waves:
        raise ValueError(f"{action} makes no run due: waves are for resume, retry and unpause")
    if ACTIONS[action].version and version is None:
        raise ValueError("choose the version to move the runs to")
    if all_matching:
        # The newest BULK_LIMIT runs matching the filter (a search's branches each cut to as
        # many, then merged): not limited to the page on screen, whatever its cursor.
        workflow_ids = list(filters.newest(clock.now(), limit=BULK_LIMIT).values_list("workflow_id", flat=True))
    workflow_ids = list(dict.fromkeys(w for w in workflow_ids if w))[:BULK_LIMIT]
    if not workflow_ids:
        raise ValueError("select at least one run")
    # No run's page can be addressed by such an id (nor can it be listed back with a link).
    unaddressable = next((w for w in workflow_ids if any(c < " " or c == "\x7f" for c in w)), None)
    if unaddressable is not None:
        raise ValueError(f"a run id cannot contain a line break or another control character: {unaddressable!r}")
    return BulkRequest(action, reason, workflow_ids, version, waves)


def bulk_preview(bulk: BulkRequest, *, actor: AbstractBaseUser) -> BulkResult:
    """The dry run: for each run, whether the action would apply now and, if not, why (the
    transitions' own judgement, transitions.why_not; for a move, also versions.move_plan: what
    the move would do, or the step the target cannot continue). Three queries whatever the
    number of runs (a move: four), and bulk_facts' one (state, causes, effects); nothing is written."""
    action, reason, workflow_ids, version = bulk.action, bulk.reason, bulk.workflow_ids, bulk.version
    now = clock.now()
    runs = {r.workflow_id: r for r in WorkflowRun.objects.filter(workflow_id__in=workflow_ids)}
    steps: dict[int, list[StepExecution]] = {}
    for step in StepExecution.objects.filter(run_id__in=[r.pk for r in runs.values()]):
        steps.setdefault(step.run_id, []).append(step)
    moving = ACTIONS[action].version
    decisions = transitions.accepted_by_run([r.pk for r in runs.values()]) if moving else {}
    result = BulkResult(
        action=action, applied=False, reason=reason, version=version if moving else None, waves=bulk.waves
    )
    for workflow_id in workflow_ids:
        run = runs.get(workflow_id)
        if run is None:
            result.refused.append((workflow_id, f"no run {workflow_id!r}"))
            continue
        situation = transitions.Situation.of(run, steps.get(run.pk, []), now)
        try:
            step = _blocked(situation) if ACTIONS[action].step == StepArg.REQUIRED else None
        except InvalidTransition as exc:
            result.refused.append((workflow_id, str(exc)))
            continue
        refused = transitions.why_not(action, situation, step_name=step, actor=actor)
        if refused is None and transitions.needs_approval(run, action):
            refused = InvalidTransition(f"{action} on {run.workflow_name} runs needs a second supervisor's approval")
        if refused is None and moving:
            note, why = _move(run, situation.steps, decisions.get(run.pk, {}), version)
            if why:
                refused = InvalidTransition(why)
            else:
                result.notes[workflow_id] = note
        if refused is None:
            result.done.append(workflow_id)
        else:
            result.refused.append((workflow_id, str(refused)))
    result.facts = bulk_facts.facts(list(runs.values()), steps, now=now)  # state, causes, effects
    return result


def _move(
    run: WorkflowRun, steps: list[StepExecution], decisions: dict[str, ModelDecision], version: int | None
) -> tuple[str, str]:
    """What moving ``run`` to ``version`` would do ("can move to v2 (adds check)") and "", or ""
    and why it cannot: the transition's own judgement (versions.move_plan). A run whose finished
    steps the target gives new keys is refused here: its page asks whether their effects stand."""
    try:
        target = registry.get_workflow(run.workflow_name, version)
    except LookupError as exc:
        return "", str(exc)
    plan = transitions.move_plan(run, steps, target, decisions)
    if not plan.ok:
        return "", plan.summary()
    if plan.effects:
        made = ", ".join(e["step"] for e in plan.effects)
        return "", (
            f"v{plan.target} gives {made} a new key version and the run made its effect under the old key: "
            "move it from its page, saying whether that effect stands"
        )
    return plan.summary(), ""


def bulk_apply(bulk: BulkRequest, *, actor: AbstractBaseUser) -> BulkResult:
    """Apply one action with one reason to many runs, each in its own transition (and audit
    event; a move to ``version`` only where that version can continue the run, never with
    effects declared standing; the runs it makes due released in ``waves``, in the order
    listed). Runs where it is not valid (any more) are listed back, untouched."""
    action, reason, workflow_ids, version = bulk.action, bulk.reason, bulk.workflow_ids, bulk.version
    result = BulkResult(action=action, reason=reason, version=version, waves=bulk.waves)
    due = bulk.waves.due_times(len(workflow_ids), clock.now())
    for workflow_id, wake_at in zip(workflow_ids, due, strict=True):
        try:
            step = _blocked_step(workflow_id) if ACTIONS[action].step == StepArg.REQUIRED else None
            when = {"wake_at": wake_at} if wake_at is not None else {}
            transitions.perform(
                action, workflow_id=workflow_id, step_name=step, actor=actor, reason=reason, version=version, **when
            )
            result.done.append(workflow_id)
        except (InvalidTransition, WorkflowRun.DoesNotExist) as exc:
            result.refused.append((workflow_id, str(exc)))
    return result


def _blocked(situation) -> str:
    """The step a bulk retry retries: the run's first failed or unknown step."""
    step = next((s for s in situation.steps if situation.state_of(s) in (StepState.FAILED, StepState.UNKNOWN)), None)
    if step is None:
        raise InvalidTransition("no failed or unknown step to retry")
    return step.step_name


def _blocked_step(workflow_id: str) -> str:
    run = WorkflowRun.objects.get(workflow_id=workflow_id)
    return _blocked(transitions.Situation.of(run, run.steps.all(), clock.now()))


def event_forms(detail: dict, user: AbstractBaseUser) -> list[dict]:
    """The events the run waits for now, or will (its waits not ended), each with a fresh key for
    its form and the fields its payload takes — for a person who may send them."""
    workflow = detail["workflow"]
    if workflow is None or not can(user, "send_event") or detail["run"].state in transitions.TERMINAL_RUN_STATES:
        return []
    states = {s.step_name: s.state for s in detail["steps"]}
    forms = []
    for spec in workflow.steps:
        wait = spec.wait
        if wait is None or wait.is_timer or states.get(spec.name) not in (StepState.PENDING, StepState.WAITING):
            continue
        fields = sorted(wait.schema.model_fields) if wait.schema is not None else []
        forms.append(
            {
                "event": wait.event,
                "step": spec.name,
                "fields": fields,
                "key": f"console:{uuid.uuid4()}",
                "waiting": states[spec.name] == StepState.WAITING,
            }
        )
    return forms
