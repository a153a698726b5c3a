import json

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from recovery import clock, deploys, registry
from recovery.engine import transitions
from recovery.errors import InvalidTransition
from recovery.management.base import RecoveryCommand
from recovery.models import WorkflowRun
from recovery.permissions import can
from recovery.text import printable


class Command(RecoveryCommand):
    help = (
        "Before a deploy, with the code about to be deployed: list the unfinished runs whose workflow version "
        "this code lacks (by workflow, version and current step) and whether each can move to the current "
        "version; exit 1 if the deploy would strand runs. --move moves those that can (audited, one transition each)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--json", dest="as_json", action="store_true", help="one JSON document on stdout (for CI)")
        parser.add_argument("--workflow", help="only this workflow's runs")
        parser.add_argument(
            "--move", action="store_true", help="move every stranded run that can to its workflow's current version"
        )
        parser.add_argument("--dry-run", action="store_true", help="--move: say what each move would do; move none")
        parser.add_argument("--reason", help="--move: the reason recorded with each move")
        parser.add_argument("--as", dest="username", help="--move: the supervisor who moves them")

    def handle(self, *args, as_json: bool, workflow, move: bool, dry_run: bool, reason, username, **options):
        if move:
            return self._move(workflow, dry_run, reason, username)
        if dry_run or reason or username:
            raise CommandError("--dry-run, --reason and --as go with --move")
        groups = deploys.stranded(workflow=workflow)
        stranded = sum(g.runs for g in groups)
        if as_json:
            self.stdout.write(_dumps(groups, stranded))
        else:
            self._report(groups, stranded)
        if stranded:
            movable = sum(g.movable for g in groups)
            raise CommandError(
                f"this deploy would strand {stranded} unfinished run(s) ({movable} can move to the current version): "
                "keep their versions deployed until they drain, or move them (check_deploy --move)"
            )

    def _report(self, groups, stranded: int) -> None:
        deployed = ", ".join(f"{name} {registry.versions_text(name)}" for name, _ in registry.deployed())
        self.stdout.write(f"this code has: {deployed or 'no workflow'}")
        if not stranded:
            self.stdout.write("no unfinished run needs a version this code lacks: safe to deploy")
            return
        for g in groups:
            at = f"at {g.step}" if g.step else "not started"
            states = ", ".join(f"{state} {n}" for state, n in sorted(g.states.items()))
            oldest = f"{g.oldest:%Y-%m-%d %H:%M} UTC" if g.oldest else "—"
            self.stdout.write(
                f"{g.workflow} v{g.version} {at}: {g.runs} run(s) ({states}; oldest {oldest}): {g.verdict()}"
            )

    def _move(self, workflow, dry_run: bool, reason, username) -> None:
        """One move_version per stranded run that can move: the same transition and checks as the
        console's and ``recover move_version``'s. One line per run; exit 1 if any was refused."""
        if not reason or not username:
            raise CommandError("--move needs --reason and --as (the supervisor who moves the runs)")
        user = get_user_model().objects.filter(username=username, is_active=True).first()
        if user is None:
            raise CommandError(f"no active user {username!r}")
        if not can(user, "move_version"):
            raise CommandError(f"{username} may not move runs: that needs the supervisor role")
        refused = moved = 0
        for run, plan in deploys.judged(deploys.stranded_runs(workflow=workflow)):
            if plan is None or not plan.ok:
                refused += 1
                why = plan.refusal if plan is not None else f"this code has no {run.workflow_name} workflow"
                self.stdout.write(printable(f"refused {run.workflow_id}: {why}"))
                continue
            if dry_run:
                moved += 1
                self.stdout.write(
                    printable(f"would move {run.workflow_id} v{plan.source} -> v{plan.target}: {plan.summary()}")
                )
                continue
            try:
                transitions.perform(
                    "move_version", workflow_id=run.workflow_id, actor=user, reason=reason, version=plan.target
                )
            except (InvalidTransition, WorkflowRun.DoesNotExist) as exc:
                refused += 1
                self.stdout.write(printable(f"refused {run.workflow_id}: {exc}"))
                continue
            moved += 1
            self.stdout.write(printable(f"moved {run.workflow_id} v{plan.source} -> v{plan.target}"))
        verb = "would move" if dry_run else "moved"
        summary = f"{verb} {moved} run(s); {refused} cannot move"
        if refused:
            raise CommandError(summary)
        self.stdout.write(summary)


def _dumps(groups, stranded: int) -> str:
    return json.dumps(
        {
            "checked_at": clock.now().isoformat(),
            "deployed": {name: list(versions) for name, versions in registry.deployed()},
            "stranded": stranded,
            "movable": sum(g.movable for g in groups),
            "groups": [g.as_json() for g in groups],
        },
        indent=2,
    )
