import json

from django.core.management.base import CommandError

from recovery.console.selectors import run_document
from recovery.management.base import RecoveryCommand
from recovery.models import WorkflowRun


class Command(RecoveryCommand):
    help = "Show a run: state, steps (keys, remote references, errors) and audit trail."

    def add_arguments(self, parser):
        parser.add_argument("workflow_id")
        parser.add_argument("--json", action="store_true", help="print JSON (the shape docs/operating.md documents)")

    def handle(self, *args, workflow_id, json: bool, **options):
        try:
            doc = run_document(workflow_id)
        except WorkflowRun.DoesNotExist:
            raise CommandError(f"no run {workflow_id!r}") from None
        if json:
            self.stdout.write(_dumps(doc))
            return
        self.stdout.write(f"{doc['workflow_id']}  {doc['state']}  {doc['status_reason']}")
        for s in doc["steps"]:
            err = f"  [{s['last_error_kind']}] {s['last_error']}" if s["last_error_kind"] else ""
            self.stdout.write(
                f"  {s['name']:<28} {s['state']:<12} attempts={s['attempts']} ref={s['remote_ref'] or '-'}{err}"
            )
            if s["refusal"]:
                values = ", ".join(f"{k}={v}" for k, v in s["refusal"]["values"].items())
                self.stdout.write(f"    refused by {s['refusal']['rule']}: {values or s['refusal']['message']}")
            for o in s["overrides"]:
                self.stdout.write(f"    {o['rule']} overridden by {o['by']} at {o['at']}: {o['reason']}")


def _dumps(doc: dict) -> str:
    return json.dumps(doc, indent=2)
