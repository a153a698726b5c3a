import json

from django.core.management.base import CommandError, CommandParser

from recovery.management.base import RecoveryCommand
from recovery.models import StepExecution
from recovery.workflow import compensation_key, idempotency_key
from sandbox import faults


class OneLineParser(CommandParser):
    """A sub-command parser whose errors are one line, like the top-level RecoveryCommand's."""

    def print_usage(self, file=None):
        pass


class Command(RecoveryCommand):
    help = "Break the simulated systems on purpose: arm faults, clear everything, count what they hold."

    def add_arguments(self, parser):
        actions = parser.add_subparsers(
            dest="action", required=True, metavar="{fault,clear,counts}", parser_class=OneLineParser
        )
        fault = actions.add_parser("fault", help="arm a fault for the next calls of SERVICE OPERATION")
        fault.add_argument("service", help="tasks | messages | ledger")
        fault.add_argument(
            "operation", help="tasks: create|cancel|find; messages: send|find|correct; ledger: post|find|reverse"
        )
        fault.add_argument(
            "mode",
            help="fail_before_commit | commit_then_drop (commits, loses the answer) | late_commit (commits after "
            "the caller gave up) | rate_limit | forbidden | unavailable | slow",
        )
        fault.add_argument("--times", type=int, default=1, help="how many calls it hits (default 1)")
        fault.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds for rate_limit")
        fault.add_argument(
            "--delay-ms",
            type=int,
            default=0,
            help="delay for slow, commit_then_drop and late_commit (the last two: 0 = read timeout + 1 s)",
        )
        actions.add_parser("clear", help="remove every fault, task, message and ledger entry")
        counts = actions.add_parser("counts", help="what the simulated systems hold")
        counts.add_argument("--json", action="store_true", help="print a JSON object")
        counts.add_argument(
            "--run",
            metavar="WORKFLOW_ID",
            help="only what this run made: objects carrying its steps' or compensations' keys (duplicates "
            "included), and ledger entries referenced by its workflow id",
        )

    def handle(self, *args, action, **options):
        if action == "fault":
            self.fault(options)
        elif action == "clear":
            faults.clear()
            self.stdout.write("cleared: no faults, tasks, messages or ledger entries remain")
        else:
            numbers = faults.counts(**_run_scope(options["run"])) if options["run"] else faults.counts()
            if options["json"]:
                self.stdout.write(json.dumps(numbers))
            else:
                self.stdout.write(" ".join(f"{name}={value}" for name, value in numbers.items()))

    def fault(self, options):
        service, operation, mode = options["service"], options["operation"], options["mode"]
        times, retry_after, delay_ms = options["times"], options["retry_after"], options["delay_ms"]
        try:
            fault = faults.set_fault(service, operation, mode, times=times, retry_after=retry_after, delay_ms=delay_ms)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        detail = {
            "rate_limit": f", Retry-After {fault.retry_after}s",
            "slow": f", delay {fault.delay_ms} ms",
        }.get(fault.mode, "")
        if fault.mode in ("commit_then_drop", "late_commit"):
            detail = f", delay {fault.delay_ms} ms" if fault.delay_ms else ", delay: read timeout + 1 s"
        self.stdout.write(
            f"armed: {fault.service} {fault.operation} {fault.mode} for the next {fault.remaining} call(s){detail}"
        )


def _run_scope(workflow_id: str) -> dict:
    """The keys a run's objects carry in the simulated systems: its steps' idempotency keys and
    its compensations' keys, every key version of them, as the engine derives them; and its
    workflow id, which the invoice's ledger entries take as their reference."""
    steps = list(StepExecution.objects.filter(run__workflow_id=workflow_id).values_list("step_name", "key_version"))
    if not steps:
        raise CommandError(f"no run {workflow_id!r}")
    keys = [
        key(workflow_id, name, v)
        for name, version in steps
        for v in range(1, version + 1)
        for key in (idempotency_key, compensation_key)
    ]
    return {"keys": keys, "reference_prefix": workflow_id}
