from django.core.management.base import CommandError

from recovery.api.tokens import issue_token
from recovery.management.base import RecoveryCommand


class Command(RecoveryCommand):
    help = "Issue an API token that may start runs of one workflow; prints the token once (only its hash is kept)."

    def add_arguments(self, parser):
        parser.add_argument("name", help="a unique name for the token, e.g. the system that will use it")
        parser.add_argument("--workflow", required=True, help="the one workflow this token may start")
        parser.add_argument(
            "--may-pause",
            action="store_true",
            help="it may also pause and release that workflow, or a step of it (POST /api/workflows/NAME/pause)",
        )
        parser.add_argument(
            "--may-decide",
            action="store_true",
            help="it may also decide the workflow's held tool calls for the people it names, whose role is "
            "checked (POST /api/runs/<id>/decisions: a chat bot)",
        )

    def handle(self, *args, name, workflow, may_pause, may_decide, **options):
        try:
            _, token = issue_token(name=name, workflow_name=workflow, may_pause=may_pause, may_decide=may_decide)
        except (LookupError, ValueError) as exc:
            raise CommandError(" ".join(str(exc).split())) from None
        self.stdout.write(token)
