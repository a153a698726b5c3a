from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from recovery.engine import transitions
from recovery.errors import InvalidTransition
from recovery.management.base import RecoveryCommand
from recovery.models import WorkflowRun
from recovery.permissions import can

ACTIONS = ("resume", "reconcile", "retry", "compensate", "terminate")


class Command(RecoveryCommand):
    help = "Apply an operator recovery action to a run, audited with the operator and a reason."

    def add_arguments(self, parser):
        parser.add_argument("action", choices=ACTIONS)
        parser.add_argument("workflow_id")
        parser.add_argument("--step", help="the step (retry, reconcile; compensate: one step instead of the run)")
        parser.add_argument("--reason", required=True)
        parser.add_argument("--as", dest="username", required=True, help="the operator's username")

    def handle(self, *args, action, workflow_id, step, reason, username, **options):
        user = get_user_model().objects.filter(username=username, is_active=True).first()
        if user is None:
            raise CommandError(f"no active user {username!r}")
        if not can(user, action):  # the console's rule (recovery.permissions), from the shell too
            raise CommandError(f"{username}'s role may not {action} runs")
        try:
            if action == "resume":
                transitions.run_resume(workflow_id=workflow_id, actor=user, reason=reason)
            elif action == "terminate":
                transitions.run_terminate(workflow_id=workflow_id, actor=user, reason=reason)
            elif action in ("retry", "reconcile"):
                if not step:
                    raise CommandError(f"{action} needs --step")
                fn = transitions.step_retry if action == "retry" else transitions.step_reconcile
                fn(workflow_id=workflow_id, step_name=step, actor=user, reason=reason)
            else:
                transitions.run_compensate(workflow_id=workflow_id, actor=user, reason=reason, step_name=step)
        except WorkflowRun.DoesNotExist:
            raise CommandError(f"no run {workflow_id!r}") from None
        except InvalidTransition as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{action}: {workflow_id} is now {WorkflowRun.objects.get(workflow_id=workflow_id).state}")
