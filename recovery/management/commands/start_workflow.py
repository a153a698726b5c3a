import json

from django.core.management.base import CommandError

from recovery.engine.transitions import run_start
from recovery.errors import StartConflict
from recovery.management.base import RecoveryCommand
from recovery.workflow import get_workflow


class Command(RecoveryCommand):
    help = "Start a workflow for a business event and print its workflow id (the same event gives the same id)."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--input", required=True, help="the event as a JSON object")

    def handle(self, *args, name, input, **options):
        try:
            workflow = get_workflow(name)
            data = json.loads(input)
            run, _ = run_start(workflow=workflow, data=data)
        except json.JSONDecodeError as exc:
            raise CommandError(f"--input is not valid JSON: {exc}") from None
        except (LookupError, ValueError, KeyError, StartConflict) as exc:
            raise CommandError(" ".join(str(exc).split())) from None
        self.stdout.write(run.workflow_id)
