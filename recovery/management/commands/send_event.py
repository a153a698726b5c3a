"""``manage.py send_event RUN EVENT --key K --payload JSON --as USER``: the console's "Send event"
(recovery.console.event_views) and the event API's ``POST /api/runs/<id>/events``, from a shell."""

from pathlib import Path

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from recovery import jsoninput
from recovery.engine.transitions import run_deliver_event
from recovery.errors import InvalidTransition
from recovery.management.base import RecoveryCommand
from recovery.models import WorkflowRun
from recovery.permissions import can, role_of


class Command(RecoveryCommand):
    help = (
        "Deliver the event a run's durable wait waits for (issue 38), as the sending system would on the API "
        "(POST /api/runs/<workflow id>/events), under the sender's idempotency key, recorded as sent by the "
        "operator --as: validated by the wait's schema; the same key again is the same event; one that comes "
        "after its wait ended is recorded late and never applied."
    )

    def add_arguments(self, parser):
        parser.add_argument("workflow_id", help="the run's workflow id (e.g. approval:acme:o-1)")
        parser.add_argument("event", help="the event's name (e.g. approved)")
        parser.add_argument("--key", required=True, help="the sender's idempotency key (e.g. tracker:17:approved)")
        payload = parser.add_mutually_exclusive_group(required=True)
        payload.add_argument("--payload", help="the event's payload, a JSON object")
        payload.add_argument("--payload-file", help="a file holding the payload (JSON); - for stdin")
        parser.add_argument("--as", dest="username", required=True, help="the operator's username")

    def handle(self, *args, workflow_id, event, key, payload, payload_file, username, **options):
        user = get_user_model().objects.filter(username=username, is_active=True).first()
        if user is None:
            raise CommandError(f"no active user {username!r}")
        if not can(user, "send_event"):
            role = role_of(user).name.lower()
            raise CommandError(f"{username} ({role}) may not send events: that needs the operator role")
        data = _payload(payload, payload_file)
        try:
            kept, new = run_deliver_event(workflow_id=workflow_id, event=event, key=key, payload=data, actor=user)
        except WorkflowRun.DoesNotExist:
            raise CommandError(f"no run {workflow_id!r}") from None
        except InvalidTransition as exc:  # EventRefused, EventConflict: one line, non-zero exit
            raise CommandError(str(exc)) from None
        said = f"event {kept.name} ({kept.key})"
        if not new:
            self.stdout.write(f"{said} already recorded for {workflow_id} (the same key): nothing new")
        elif kept.late:
            self.stdout.write(f"{said} recorded late for {workflow_id}: its wait had ended, it is not applied")
        elif kept.step_name:
            self.stdout.write(f"{said} recorded for {workflow_id}: the run goes on")
        else:
            self.stdout.write(f"{said} recorded for {workflow_id}: kept for its wait, used when the run reaches it")


def _payload(text: str | None, path: str | None) -> dict:
    """The payload from --payload or --payload-file: a JSON object within the API's bounds
    (recovery.jsoninput), or a CommandError naming what is wrong."""
    what = "--payload" if path is None else f"--payload-file {path}"
    if path is not None:
        try:
            text = Path("/dev/stdin" if path == "-" else path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        jsoninput.check_size(text or "", what=what)
        value = jsoninput.loads(text or "", what=what)
        if not isinstance(value, dict):
            raise CommandError(f"{what} must be a JSON object")
        jsoninput.check_storable(value, what=what)
    except jsoninput.Refused as exc:
        raise CommandError(str(exc)) from None
    return value
