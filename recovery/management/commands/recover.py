from pathlib import Path

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from recovery import clock
from recovery.actions import (
    ACTIONS,
    DECISIONS,
    MAX_SNOOZE_HOURS,
    SNOOZE_DEFAULT_HOURS,
    StepArg,
    parse_decision,
    parse_hours,
    parse_object,
    parse_version,
)
from recovery.engine import evidence, transitions
from recovery.errors import InvalidTransition
from recovery.management.base import RecoveryCommand
from recovery.models import WorkflowRun
from recovery.workflow import get_workflow


class Command(RecoveryCommand):
    help = (
        "Apply an operator recovery action to a run, audited with the operator and a reason: the console's "
        "actions, through the same transition and the same checks (role, state, four-eyes)."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "action",
            choices=[*ACTIONS, *DECISIONS],
            help="; ".join(f"{name}: {action.label}" for name, action in ACTIONS.items())
            + "; approve, reject: a four-eyes request on this run (--request)",
        )
        parser.add_argument("workflow_id")
        parser.add_argument(
            "--step",
            help="the step (retry, reconcile, resolve_*, supersede, decide_again, override; "
            "compensate: one step instead of the run; stop_agent: the agent step; fork_agent: the turn, "
            "e.g. resolve_dispute:2; approve_call, edit_call, reject_call, answer_call: the held call, "
            "e.g. resolve_dispute:2:0:issue_credit_note; take: that call, or a wait step)",
        )
        parser.add_argument(
            "--remote-ref",
            default="",
            help="resolve_happened: the remote id that shows it happened (looked up at the receiver)",
        )
        parser.add_argument(
            "--result",
            default=None,
            help="resolve_happened, where the receiver cannot be asked by id: the step's result (JSON, its schema)",
        )
        decision = parser.add_mutually_exclusive_group()
        decision.add_argument(
            "--decision",
            help="supersede: the new decision; edit_call: the held call's arguments; answer_call: the answer "
            "in the tool's place (a JSON object)",
        )
        decision.add_argument("--decision-file", help="the same, from a file (JSON); - for stdin")
        parser.add_argument(
            "--hours",
            help=f"snooze_alert: how long, in hours ({SNOOZE_DEFAULT_HOURS} if not given; at most {MAX_SNOOZE_HOURS})",
        )
        parser.add_argument("--to-version", help="move_version: the registered version to move the run to")
        corrected = parser.add_mutually_exclusive_group()
        corrected.add_argument("--input", help="restart: the run's corrected input, a JSON object")
        corrected.add_argument("--input-file", help="restart: a file holding the corrected input (JSON); - for stdin")
        corrected.add_argument("--intent", help="restart: the step's intent fields to correct, a JSON object")
        corrected.add_argument("--intent-file", help="restart: a file holding them (JSON); - for stdin")
        parser.add_argument(
            "--effects-stand",
            action="store_true",
            help="move_version: the effects made under a key version the target changes stand (keep them); "
            "restart: the effects whose step declares a second effect stand beside the second one",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="move_version, restart: say whether it is possible and what it changes (the difference, each "
            "effect's fate); nothing is written",
        )
        parser.add_argument("--request", help="approve, reject: the request's id (manage.py approval list)")
        parser.add_argument("--reason", required=True)
        parser.add_argument("--as", dest="username", required=True, help="the operator's username")

    def handle(
        self,
        *args,
        action,
        workflow_id,
        step,
        remote_ref,
        result,
        decision,
        decision_file,
        input,
        input_file,
        intent,
        intent_file,
        hours,
        to_version,
        effects_stand,
        dry_run,
        request,
        reason,
        username,
        **options,
    ):
        user = get_user_model().objects.filter(username=username, is_active=True).first()
        if user is None:
            raise CommandError(f"no active user {username!r}")
        if action in DECISIONS:
            return self._decide(action, workflow_id, request, user, reason)
        if ACTIONS[action].step == StepArg.REQUIRED and not step:
            raise CommandError(f"{action} needs --step")
        if dry_run and not (ACTIONS[action].version or ACTIONS[action].correction):
            raise CommandError(f"--dry-run is for move_version and restart, not {action}")
        try:
            version = parse_version(to_version)
            correction = _correction(action, input, input_file, intent, intent_file)
            if dry_run and correction is not None:
                self.stdout.write("\n".join(_restart_plan(workflow_id, step, correction, effects_stand, user)))
                return
            if dry_run:
                self.stdout.write(f"{workflow_id}: {_move_plan(workflow_id, version, user)}")
                return
            edited = _decision(decision, decision_file) if ACTIONS[action].decision else None
            transitions.require_reason(reason)
            checked = evidence.examine(
                action, workflow_id=workflow_id, step_name=step, remote_ref=remote_ref, result=result, actor=user
            )
            transitions.perform(
                action,
                workflow_id=workflow_id,
                step_name=step,
                evidence=checked,
                decision=edited,
                hours=parse_hours(hours),
                version=version,
                effects_stand=effects_stand,
                correction=correction,
                actor=user,
                reason=reason,
            )
        except WorkflowRun.DoesNotExist:
            raise CommandError(f"no run {workflow_id!r}") from None
        except InvalidTransition as exc:  # also NotPermitted and ApprovalRequired: one line, non-zero exit
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{action}: {workflow_id} is now {WorkflowRun.objects.get(workflow_id=workflow_id).state}")

    def _decide(self, action, workflow_id, request_id, user, reason):
        """The run page's approve / reject of a four-eyes request, through the same transition."""
        if not request_id:
            raise CommandError(f"{action} needs --request (manage.py approval list --run {workflow_id})")
        try:
            decided = transitions.approval_decide(
                action, request_id=request_id, workflow_id=workflow_id, actor=user, reason=reason
            )
        except InvalidTransition as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(
            f"{action}: request {decided.pk} is {decided.state}; {workflow_id} is now {decided.run.state}"
        )


def _move_plan(workflow_id: str, version: int | None, user) -> str:
    """The dry run of a move, judged as the transition would judge it now (the role, the run's
    state, then ``move_plan``); nothing is written."""
    run = WorkflowRun.objects.get(workflow_id=workflow_id)
    if version is None:
        raise InvalidTransition("move_version needs --to-version")
    try:
        target = get_workflow(run.workflow_name, version)
    except LookupError as exc:
        raise InvalidTransition(str(exc)) from None
    steps = list(run.steps.all())
    refused = transitions.why_not("move_version", transitions.Situation.of(run, steps, clock.now()), actor=user)
    if refused is not None:
        return f"cannot move: {refused}"
    return transitions.move_plan(run, steps, target, transitions.accepted_decisions(run)).summary()


def _restart_plan(workflow_id: str, step: str | None, correction, effects_stand: bool, user) -> list[str]:
    """The dry run of a restart, judged as the transition would judge it now; nothing is written."""
    run = WorkflowRun.objects.get(workflow_id=workflow_id)
    situation = transitions.Situation.of(run, list(run.steps.all()), clock.now())
    edited, value = correction
    plan = transitions.restart_preview(
        situation, step, actor=user, edited=edited, value=value, effects_stand=effects_stand
    )
    return [f"{workflow_id}: {plan.lines()[0]}", *plan.lines()[1:]]


def _correction(action: str, *given) -> tuple[str, dict] | None:
    """A restart's correction from --input(-file) or --intent(-file): ("input" | "intent", the JSON object)."""
    input_text, input_file, intent_text, intent_file = given
    if not ACTIONS[action].correction:
        if any(value is not None for value in given):
            raise InvalidTransition(f"--input and --intent are for restart, not {action}")
        return None
    if input_text is not None or input_file is not None:
        return "input", parse_object(_read(input_text, input_file), "the corrected input")
    if intent_text is not None or intent_file is not None:
        return "intent", parse_object(_read(intent_text, intent_file), "the corrected intent")
    raise InvalidTransition("restart needs the corrected input (--input-file) or the step's intent (--intent-file)")


def _read(text: str | None, path: str | None) -> str:
    if path is None:
        return text or ""
    try:
        return Path("/dev/stdin" if path == "-" else path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidTransition(f"cannot read {path}: {exc.strerror}") from None


def _decision(text: str | None, path: str | None) -> dict:
    return parse_decision(_read(text, path))
