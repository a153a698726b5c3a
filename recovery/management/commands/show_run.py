import json

from django.core.management.base import CommandError

from recovery import clock
from recovery.console.selectors import run_document
from recovery.management.base import RecoveryCommand
from recovery.models import WorkflowRun


class Command(RecoveryCommand):
    help = (
        "Show a run: its state and why it is not moving, its steps (idempotency keys, remote references, "
        "errors, a guard's refusal) and its audit trail."
    )

    def add_arguments(self, parser):
        parser.add_argument("workflow_id")
        parser.add_argument("--json", action="store_true", help="print JSON (the shape docs/operating.md documents)")

    def handle(self, *args, workflow_id, json: bool, **options):
        try:
            doc = run_document(workflow_id, now=clock.now())
        except WorkflowRun.DoesNotExist:
            raise CommandError(f"no run {workflow_id!r}") from None
        if json:
            self.stdout.write(_dumps(doc))
            return
        write = self.stdout.write
        write(f"{doc['workflow_id']}  {doc['state']}  {doc['status_reason']}")
        write(f"  why: {doc['why']}")
        for s in doc["steps"]:
            err = f"  [{s['last_error_kind']}] {s['last_error']}" if s["last_error_kind"] else ""
            write(f"  {s['name']:<28} {s['state']:<12} attempts={s['attempts']} ref={s['remote_ref'] or '-'}{err}")
            write(f"    key {s['idempotency_key']}")
            if s["refusal"]:
                values = ", ".join(f"{k}={v}" for k, v in sorted(s["refusal"]["values"].items()))
                write(f"    refused by {s['refusal']['rule']}: {values or s['refusal']['message']}")
            for o in s["overrides"]:
                write(f"    {o['rule']} overridden by {o['by']} at {o['at']}: {o['reason']}")
        write(f"  audit trail ({len(doc['audit'])} events, oldest first):")
        for e in doc["audit"]:
            step = f" {e['step']}" if e["step"] else ""
            reason = f": {e['reason']}" if e["reason"] else ""
            write(f"    {e['at'][:19]}  {e['actor']:<14} {e['action']}{step}{reason}")


def _dumps(doc: dict) -> str:
    return json.dumps(doc, indent=2)
