"""Helpers the console tests share: a logged-in client of a role, runs in the states the
console acts on, and an action posted as the run page posts it."""

import html
import re

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.test import Client
from django.urls import reverse

from recovery.engine.transitions import run_start, run_version
from tests.support import receivers, workflows
from tests.support.engine import drive


def login(role: str | None) -> Client:
    user = get_user_model().objects.create_user(f"u-{role}", password="pw")
    if role:
        user.groups.add(Group.objects.get_or_create(name=role)[0])  # a flush drops the migration's rows
    client = Client()
    client.force_login(user)
    return client


def failed_run(clock, order_id="o-1", *, workflow="test_orders"):
    receivers.arm("task", "forbidden")
    return drive(run_start(workflow=workflow, data={"tenant": "t", "order_id": order_id})[0], clock)


def unknown_run(clock, monkeypatch, order_id="o-u", *, workflow="test_orders"):
    receivers.arm("message", "commit_then_drop")
    monkeypatch.setattr(workflows.notify, "lookup_fn", lambda ctx: (_ for _ in ()).throw(RuntimeError("down")))
    return drive(run_start(workflow=workflow, data={"tenant": "t", "order_id": order_id})[0], clock)


def act(client, run, action, *, step="", reason="checked with the team", version=None, htmx=True, **extra):
    data = {"action": action, "step": step, "reason": reason, "version": version or run_version(run), **extra}
    headers = {"HX-Request": "true", "HX-Target": "run-body"} if htmx else {}
    return client.post(reverse("console:run-action", args=[run.workflow_id]), data, headers=headers)


def confirm(client, preview) -> object:
    """Post the dry run page's confirmation form as it is."""
    form = preview.text.split('class="bulk-confirm"')[1].split("</form>")[0]
    fields = re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', form)
    data: dict[str, list[str]] = {}
    for name, value in fields:
        data.setdefault(name, []).append(html.unescape(value))
    return client.post(reverse("console:bulk"), data)
