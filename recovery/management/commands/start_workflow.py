import sys
from itertools import islice

from django.core.management.base import CommandError

from recovery import jsoninput
from recovery.engine.transitions import run_start, run_start_many
from recovery.errors import StartConflict
from recovery.management.base import RecoveryCommand
from recovery.text import printable
from recovery.workflow import get_workflow


class Command(RecoveryCommand):
    help = (
        "Start a workflow for a business event and print its workflow id (the same event gives the same id); "
        "with --input-file, one event per line (JSON Lines), started in batches."
    )

    def create_parser(self, prog_name, subcommand, **kwargs):
        # --version is the workflow's version here, not Django's (which ``manage.py version`` prints).
        return super().create_parser(prog_name, subcommand, conflict_handler="resolve", **kwargs)

    def add_arguments(self, parser):
        parser.add_argument("name")
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument("--input", help="the event as a JSON object")
        source.add_argument("--input-file", help="a JSON Lines file of events, one per line; - for stdin")
        parser.add_argument("--batch", type=int, default=100, help="events started together (100; 1 to 1000)")
        parser.add_argument(
            "--version",
            type=int,
            help="start on this registered version instead of the current one (a canary, a test); the run "
            "executes on it to the end",
        )

    def handle(self, *args, name, input, input_file, batch, version, **options):
        try:
            workflow = get_workflow(name, version)
        except LookupError as exc:
            raise CommandError(str(exc)) from None
        if input_file is not None:
            self._many(workflow, input_file, batch)
            return
        try:
            data = jsoninput.loads(input, what="--input")
            jsoninput.check_storable(data, what="--input")  # the bounds of an event on the API
        except jsoninput.Refused as exc:
            raise CommandError(str(exc)) from None
        try:
            run, _ = run_start(workflow=workflow, data=data)
        except (ValueError, KeyError, StartConflict) as exc:
            raise CommandError(" ".join(str(exc).split())) from None
        self.stdout.write(printable(run.workflow_id))

    def _many(self, workflow, path: str, batch: int) -> None:
        """One line out per line in: ``created|existing WORKFLOW_ID``, or ``conflict|invalid line N:
        why``. Each event is decided alone; exit 1 (one line on stderr) if any was refused."""
        if not 1 <= batch <= 1000:
            raise CommandError(f"--batch must be from 1 to 1000, got {batch}")
        try:
            lines = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise CommandError(f"cannot read {path}: {exc.strerror}") from None
        refused = total = 0
        with lines:
            numbered = ((n, line) for n, line in enumerate(lines, 1) if line.strip())
            while chunk := list(islice(numbered, batch)):
                events, unreadable = [], {}
                for n, line in chunk:
                    try:
                        event = jsoninput.loads(line, what="the line")
                        jsoninput.check_storable(event, what="the event")
                        events.append(event)
                    except jsoninput.Refused as exc:
                        unreadable[n] = str(exc).removeprefix("the line is ")
                        events.append(None)
                results = run_start_many(workflow=workflow, events=[e for e in events if e is not None])
                answers = iter(results)
                for n, _ in chunk:
                    total += 1
                    if n in unreadable:
                        refused += 1
                        self.stdout.write(printable(f"invalid line {n}: {unreadable[n]}"))
                        continue
                    result = next(answers)
                    if result.outcome in ("created", "existing"):
                        self.stdout.write(printable(f"{result.outcome} {result.workflow_id}"))
                    else:
                        refused += 1
                        self.stdout.write(printable(f"{result.outcome} line {n}: {' '.join(result.error.split())}"))
        if refused:
            raise CommandError(f"{refused} of {total} events refused (see the lines above); the others were started")
