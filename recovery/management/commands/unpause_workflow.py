from django.core.management.base import CommandError

from recovery.engine import transitions
from recovery.errors import InvalidTransition
from recovery.management.base import RecoveryCommand
from recovery.management.commands.pause_workflow import actor


class Command(RecoveryCommand):
    help = (
        "Release a workflow's pause (or one step's, with --step) and then each run it holds, audited on each "
        "run with who and why (supervisor)."
    )

    def add_arguments(self, parser):
        parser.add_argument("workflow", help="the workflow's name (e.g. invoice)")
        parser.add_argument("--step", default="", help="the paused step, if the pause is of one step")
        parser.add_argument("--reason", required=True)
        parser.add_argument("--as", dest="username", required=True, help="the supervisor's username")

    def handle(self, *args, workflow, step, reason, username, **options):
        user = actor(workflow, reason, username)
        try:
            done = transitions.workflow_unpause(workflow=workflow, step_name=step, actor=user, reason=reason)
        except InvalidTransition as exc:  # also NotPermitted: one line, non-zero exit
            raise CommandError(str(exc)) from None
        self.stdout.write(f"unpaused: {done['pause'].scope}; {len(done['released'])} run(s) released")
        for workflow_id, why in done["refused"].items():
            self.stdout.write(f"not released: {workflow_id}: {why}")
