from django.core.management.base import CommandError

from recovery import clock
from recovery.engine import transitions
from recovery.errors import InvalidTransition
from recovery.management.base import RecoveryCommand
from recovery.management.commands.pause_workflow import actor


class Command(RecoveryCommand):
    help = (
        "Release a workflow's pause (or one step's, with --step) and the runs it holds or kept pending, audited on "
        "each run (supervisor): at once, or in waves (--wave-size N --wave-seconds S: N runs a wave, S seconds "
        "apart, each at a random moment of its wave); --canary N releases only the N oldest while the pause stays."
    )

    def add_arguments(self, parser):
        parser.add_argument("workflow", help="the workflow's name (e.g. invoice)")
        parser.add_argument("--step", default="", help="the paused step, if the pause is of one step")
        parser.add_argument("--canary", type=int, default=0, help="release only this many runs, the oldest, first")
        parser.add_argument("--wave-size", default="", help="runs a wave")
        parser.add_argument("--wave-seconds", default="", help="seconds between two waves")
        parser.add_argument("--reason", required=True)
        parser.add_argument("--as", dest="username", required=True, help="the supervisor's username")

    def handle(self, *args, workflow, step, canary, wave_size, wave_seconds, reason, username, **options):
        user = actor(workflow, reason, username)
        try:
            waves = transitions.Waves.parse(wave_size, wave_seconds)
            if canary and waves.size:
                raise InvalidTransition("a canary is released at once: --canary or waves, not both")
            done = transitions.workflow_unpause(
                workflow=workflow, step_name=step, actor=user, reason=reason, canary=canary, waves=waves
            )
        except InvalidTransition as exc:  # also NotPermitted: one line, non-zero exit
            raise CommandError(str(exc)) from None
        scope, n = done["pause"].scope, len(done["released"])
        if done["canary"]:
            self.stdout.write(f"canary: {n} run(s) of {scope} released; the pause stays in force")
        else:
            self.stdout.write(f"unpaused: {scope}; {n} run(s) released {waves.text(n)}")
        for workflow_id in done["released"]:
            due = done["due"].get(workflow_id)
            self.stdout.write(f"{workflow_id}\t{'due at ' + clock.time_of_day(due) if due else 'due now'}")
