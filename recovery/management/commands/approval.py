from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from recovery.actions import FOUR_EYES_ACTIONS, PERMISSION_OF
from recovery.engine import evidence, transitions
from recovery.errors import InvalidTransition
from recovery.management.base import RecoveryCommand
from recovery.models import ApprovalRequest, ApprovalState, WorkflowRun
from recovery.permissions import can
from recovery.text import printable


class Command(RecoveryCommand):
    help = (
        "Four-eyes actions (a workflow's four_eyes): list the requests waiting for a second supervisor, "
        "request an action, approve or reject a request."
    )

    def add_arguments(self, parser):
        verbs = parser.add_subparsers(dest="verb", required=True)
        listing = verbs.add_parser("list", help="requests waiting for approval")
        listing.add_argument("--run", help="one run, by workflow id")
        request = verbs.add_parser("request", help="ask for an action that needs a second supervisor")
        request.add_argument("action", choices=sorted(FOUR_EYES_ACTIONS))
        request.add_argument("workflow_id")
        request.add_argument("--step", help="compensate one step; the step that succeeded (resolve_happened)")
        request.add_argument("--remote-ref", default="", help="resolve_happened: the remote id that shows it")
        request.add_argument(
            "--result", default=None, help="resolve_happened, where the receiver cannot be asked: the result (JSON)"
        )
        request.add_argument("--reason", required=True)
        request.add_argument("--as", dest="username", required=True)
        for verb in ("approve", "reject"):
            decide = verbs.add_parser(verb, help=f"{verb} a pending request (a supervisor)")
            decide.add_argument("request_id")
            decide.add_argument("--reason", required=True)
            decide.add_argument("--as", dest="username", required=True)

    def handle(self, *args, verb, **options):
        if verb == "list":
            return self._list(options["run"])
        user = get_user_model().objects.filter(username=options["username"], is_active=True).first()
        if user is None:
            raise CommandError(f"no active user {options['username']!r}")
        permission = PERMISSION_OF[options["action"] if verb == "request" else verb]
        if not can(user, permission):
            raise CommandError(f"{user.get_username()}'s role may not {permission} runs")
        try:
            transitions.require_reason(options["reason"])  # before the receiver is asked for the evidence
            if verb == "request":
                checked = evidence.examine(
                    options["action"],
                    workflow_id=options["workflow_id"],
                    step_name=options["step"],
                    remote_ref=options["remote_ref"],
                    result=options["result"],
                    actor=user,
                )
                made = transitions.approval_request(
                    workflow_id=options["workflow_id"],
                    action=options["action"],
                    step_name=options["step"],
                    evidence=checked,
                    actor=user,
                    reason=options["reason"],
                )
                self.stdout.write(f"request {made.pk}: {made.action} waits for a second supervisor's approval")
            elif verb == "approve":
                run = transitions.approval_grant(request_id=options["request_id"], actor=user, reason=options["reason"])
                self.stdout.write(f"approved {options['request_id']}: {run.workflow_id} is now {run.state}")
            else:
                transitions.approval_reject(request_id=options["request_id"], actor=user, reason=options["reason"])
                self.stdout.write(f"rejected {options['request_id']}")
        except WorkflowRun.DoesNotExist:
            raise CommandError(f"no run {options['workflow_id']!r}") from None
        except InvalidTransition as exc:
            raise CommandError(str(exc)) from None

    def _list(self, run: str | None) -> None:
        pending = ApprovalRequest.objects.filter(state=ApprovalState.PENDING).select_related("run", "requested_by")
        if run is not None:
            pending = pending.filter(run__workflow_id=run)
        for request in pending.order_by("requested_at", "pk"):
            # One line per request, tab-separated: its stored text with every control character
            # (line breaks and tabs too) shown as an escape.
            fields = [
                request.pk,
                request.action + (f" {request.step_name}" if request.step_name else ""),
                request.run.workflow_id,
                request.requested_by.get_username(),
                request.requested_at.isoformat(),
                request.reason,
            ]
            self.stdout.write("\t".join(printable(f).replace("\t", "\\t") for f in fields))
