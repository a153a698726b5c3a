from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from recovery.actions import ACTIONS, StepArg
from recovery.engine import transitions
from recovery.errors import InvalidTransition
from recovery.management.base import RecoveryCommand
from recovery.models import WorkflowRun
from recovery.permissions import can


class Command(RecoveryCommand):
    help = "Apply an operator recovery action to a run, audited with the operator and a reason."

    def add_arguments(self, parser):
        parser.add_argument("action", choices=list(ACTIONS))
        parser.add_argument("workflow_id")
        parser.add_argument(
            "--step", help="the step (retry, reconcile, resolve_*; compensate: one step instead of the run)"
        )
        parser.add_argument("--remote-ref", default="", help="resolve_happened: the remote id that shows it happened")
        parser.add_argument("--reason", required=True)
        parser.add_argument("--as", dest="username", required=True, help="the operator's username")

    def handle(self, *args, action, workflow_id, step, remote_ref, reason, username, **options):
        user = get_user_model().objects.filter(username=username, is_active=True).first()
        if user is None:
            raise CommandError(f"no active user {username!r}")
        spec = ACTIONS[action]
        if not can(user, spec.permission):  # the console's rule (recovery.permissions), from the shell too
            raise CommandError(f"{username}'s role may not {action} runs")
        if spec.step == StepArg.REQUIRED and not step:
            raise CommandError(f"{action} needs --step")
        try:
            transitions.perform(
                action, workflow_id=workflow_id, step_name=step, remote_ref=remote_ref, actor=user, reason=reason
            )
        except WorkflowRun.DoesNotExist:
            raise CommandError(f"no run {workflow_id!r}") from None
        except InvalidTransition as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{action}: {workflow_id} is now {WorkflowRun.objects.get(workflow_id=workflow_id).state}")
