"""``manage.py inbox``: the console's Inbox from a shell — everything waiting for a person, oldest
first (recovery.inbox). Deciding an item is ``manage.py recover approve_call|edit_call|reject_call|
answer_call RUN --step CALL``, taking it ``manage.py recover take RUN --step STEP``; a four-eyes
request ``manage.py approval``."""

from django.core.management.base import CommandError

from recovery import clock, inbox
from recovery.management.base import RecoveryCommand
from recovery.text import printable
from recovery.waiting import a_role


class Command(RecoveryCommand):
    help = (
        "List what waits for a person (issue 38): tool calls to approve, runs waiting for an event a person may "
        "send (or whose wait ran out), four-eyes requests; with who may act, the deadline and what happens at it, "
        "and who took it."
    )

    def add_arguments(self, parser):
        parser.add_argument("--role", choices=["operator", "supervisor"], help="what this role may act on")
        parser.add_argument("--workflow", default="", help="one workflow's items")
        parser.add_argument("--tenant", default="", help="one tenant's items (the run input's tenant)")
        parser.add_argument("--older-than", type=float, help="asked longer ago than this many hours")
        parser.add_argument("--kind", choices=list(inbox.KINDS), help="one kind of item")
        parser.add_argument("--json", action="store_true", help="one JSON object per line")

    def handle(self, *args, role, workflow, tenant, older_than, kind, json, **options):
        from datetime import timedelta

        if older_than is not None and older_than < 0:
            raise CommandError("--older-than is a number of hours, 0 or more")
        now = clock.now()
        found = inbox.items(
            now,
            role=role or "",
            workflow=workflow,
            tenant=tenant,
            older_than=timedelta(hours=older_than) if older_than is not None else None,
            kind=kind or "",
        )
        if json:
            import json as json_module

            for item in found:
                self.stdout.write(json_module.dumps(item.as_json(now), sort_keys=True))
            return
        if not found:
            self.stdout.write("nothing waits for a person")
            return
        for item in found:
            age = _age(item.age(now).total_seconds())
            until = f"until {item.deadline:%Y-%m-%d %H:%M} UTC, then {item.then}" if item.deadline else item.then
            taken = f"; taken by {item.assignee}" if item.assignee else ""
            overdue = " OVERDUE" if item.overdue else ""
            self.stdout.write(
                printable(
                    f"{item.workflow_id}  {item.step or '(run)'}  {inbox.KINDS[item.kind]} for {a_role(item.role)}"
                    f"{overdue}: {item.what[:160]} — asked {age} ago, {until}{taken}"
                )
            )


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"
