from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from recovery import clock
from recovery.engine import transitions
from recovery.errors import InvalidTransition
from recovery.management.base import RecoveryCommand


class Command(RecoveryCommand):
    help = (
        "Pause a whole workflow, or one step of it, during an incident (supervisor; audited with a reason): "
        "new events are accepted and their runs kept pending; runs under way stop before their next attempt "
        "(of that step only, with --step), once a call in flight is recorded. --list shows the pauses in force. "
        "unpause_workflow releases a pause and the runs it holds."
    )

    def add_arguments(self, parser):
        parser.add_argument("workflow", nargs="?", help="the workflow's name (e.g. invoice)")
        parser.add_argument("--step", default="", help="pause this step only (runs go on up to it)")
        parser.add_argument("--reason", help="why (shown on every run it stops)")
        parser.add_argument("--as", dest="username", help="the supervisor's username")
        parser.add_argument(
            "--list", dest="listing", action="store_true", help="list the pauses in force, and nothing else"
        )

    def handle(self, *args, workflow, step, reason, username, listing, **options):
        if listing:
            for pause in transitions.workflow_pauses_in_force():
                at = f"{pause.paused_at:%Y-%m-%d %H:%M:%S} UTC"
                self.stdout.write(f"{pause.scope}\tpaused by {pause.paused_by} at {at}: {pause.reason}")
            return
        user = actor(workflow, reason, username)
        try:
            pause = transitions.workflow_pause(workflow=workflow, step_name=step, actor=user, reason=reason)
        except InvalidTransition as exc:  # also NotPermitted: one line, non-zero exit
            raise CommandError(str(exc)) from None
        self.stdout.write(f"paused: {pause.scope}, by {pause.paused_by} at {clock.time_of_day(pause.paused_at)}")


def actor(workflow: str | None, reason: str | None, username: str | None):
    """The active user named by --as, once the workflow and --reason are given."""
    for value, name in ((workflow, "the workflow's name"), (reason, "--reason"), (username, "--as")):
        if not value:
            raise CommandError(f"{name} is required")
    user = get_user_model().objects.filter(username=username, is_active=True).first()
    if user is None:
        raise CommandError(f"no active user {username!r}")
    return user
