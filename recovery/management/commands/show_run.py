import json
import time
from datetime import datetime

from django.conf import settings
from django.core.management.base import CommandError
from django.utils.timezone import localtime

from recovery import clock, executors, recommend, why
from recovery.clock import time_of_day
from recovery.console.selectors import run_document
from recovery.engine.transitions import DONE_STEP_STATES, lease_is_live, waits_for_event
from recovery.management.base import RecoveryCommand
from recovery.models import RunState, WorkflowRun
from recovery.text import printable

# States an executor moves on by itself; a run in one of them is still on its way.
MOVING = frozenset({RunState.PENDING, RunState.WAITING, RunState.COMPENSATING})
POLL_SECONDS = 0.5


class Command(RecoveryCommand):
    help = (
        "Show a run: its state and why it is not moving, its steps (idempotency keys, remote references, "
        "errors, a guard's refusal) and its audit trail."
    )

    def add_arguments(self, parser):
        parser.add_argument("workflow_id")
        parser.add_argument("--json", action="store_true", help="print JSON (the shape docs/operating.md documents)")
        parser.add_argument(
            "--wait",
            type=float,
            default=0,
            metavar="SECONDS",
            help="first wait, up to SECONDS, until no executor moves the run on by itself: it is finished, "
            "waits for a person, or its executor's lease expired; then show it (exit 1 if it is still moving)",
        )

    def handle(self, *args, workflow_id, json: bool, wait: float, **options):
        if wait < 0:
            raise CommandError("--wait must be 0 or more seconds")
        moving = _wait_until_resting(workflow_id, wait) if wait else False
        try:
            doc = run_document(workflow_id, now=clock.now())
        except WorkflowRun.DoesNotExist:
            raise CommandError(f"no run {workflow_id!r}") from None
        self._show(doc, json)
        if not json:
            _recommended(self.stdout.write, workflow_id)
        if moving:
            raise CommandError(f"{workflow_id} is still {doc['state']} after {wait:g} s: {doc['why']}")

    def _show(self, doc: dict, json: bool) -> None:
        if json:
            self.stdout.write(_dumps(doc))
            return
        # Stored text (reasons, actors, errors, ids: people's and other systems' words) is printed
        # through printable: a control character shows as an escape, the terminal never acts on it.
        p = printable
        write = self.stdout.write
        wid = p(doc["workflow_id"])
        write(f"{wid}  {doc['state']}  {p(doc['status_reason'])}")
        write(f"  why: {p(doc['why'])}")
        write(f"  page: {settings.RECOVERY_CONSOLE_URL}/runs/{wid}")
        for s in doc["steps"]:
            # A step that got past its error keeps it as history, not as its state.
            earlier = "earlier: " if s["state"] in DONE_STEP_STATES else ""
            # An error of many lines (a validation error: one problem a line) is printed whole.
            first, *more = p(s["last_error"] or "", multiline=True).split("\n")
            err = f"  {earlier}[{s['last_error_kind']}] {first}" if s["last_error_kind"] else ""
            ref = p(s["remote_ref"] or "-")
            write(f"  {p(s['name']):<28} {s['state']:<12} attempts={s['attempts']} ref={ref}{err}")
            if s["last_error_kind"]:
                for line in more:
                    write(f"      {line}")
            write(f"    key {p(s['idempotency_key'])}")
            if s["refusal"]:
                values = ", ".join(f"{p(k)}={p(v)}" for k, v in sorted(s["refusal"]["values"].items()))
                write(f"    refused by {p(s['refusal']['rule'])}: {values or p(s['refusal']['message'])}")
            for o in s["overrides"]:
                write(f"    {p(o['rule'])} overridden by {p(o['by'])} at {o['at']}: {p(o['reason'])}")
        write(f"  audit trail ({len(doc['audit'])} events, oldest first):")
        for e in doc["audit"]:
            step = f" {p(e['step'])}" if e["step"] else ""
            reason = f": {p(e['reason'], multiline=True)}" if e["reason"] else ""
            line = f"    {_when(e['at'])}  {p(e['actor']):<14} {e['action']}{step}{reason}"
            write(line.replace("\n", "\n      "))


def _recommended(write, workflow_id: str) -> None:
    """The console's recommended action for a stuck run (recovery.recommend), with its command line."""
    advice = recommend.for_run(WorkflowRun.objects.get(workflow_id=workflow_id), clock.now())
    if advice is not None:
        write(f"  recommended: {printable(recommend.said(advice))}")
        if advice.command:
            write(f"    {printable(advice.command)}")


def _when(iso: str) -> str:
    """An audit event's time as people read it, with its zone: "2026-12-03 14:03:10 UTC" (the
    JSON keeps ISO 8601)."""
    at = datetime.fromisoformat(iso)
    return f"{localtime(at):%Y-%m-%d} {time_of_day(at)}"


def _dumps(doc: dict) -> str:
    return json.dumps(doc, indent=2)


def _wait_until_resting(workflow_id: str, seconds: float) -> bool:
    """Poll the run until it rests or ``seconds`` pass; True if it is still moving then."""
    deadline = time.monotonic() + seconds
    while True:
        run = WorkflowRun.objects.filter(workflow_id=workflow_id).first()
        if run is None:
            raise CommandError(f"no run {workflow_id!r}")
        now = clock.now()
        # A run whose executor died rests only while no executor is live: a live one takes it over.
        held = run.state == RunState.RUNNING and (lease_is_live(run, now) or executors.any_live(now))
        kept = why.kept_by(run, why.whole_pauses([run])) is not None  # rests until its workflow is unpaused
        # A run at a wait for an event, or with a tool call held for a person, rests until one acts.
        for_person = run.state == RunState.WAITING and waits_for_event(run) is not None
        moving = (run.state in MOVING and not kept and not for_person) or held
        if not moving or time.monotonic() >= deadline:
            return moving
        time.sleep(POLL_SECONDS)
