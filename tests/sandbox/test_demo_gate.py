"""The demo only where it is wanted (issue 34, item 5; docs/security.md "The demo in production"):
with RECOVERY_DEMO off, /demo answers 404 to every method and everybody, changes nothing, the
console links no demo, and seed_demo refuses unless told on purpose. With it on (make run, the
test settings), the page works as before."""

from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.checks import run_checks
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse

from recovery.models import AuditEvent, WorkflowRun
from sandbox import faults
from sandbox.models import Fault
from tests.support.console import login

pytestmark = pytest.mark.django_db(databases=["default", "sandbox"])

POSTS = [
    {"what": "fault", "target": "ledger post", "mode": "forbidden", "times": "100000"},
    {"what": "clear", "confirm": "yes"},
    {"what": "start", "invoice_id": "inv-gate", "text": "Chairs. Total due EUR 120.00"},
    {"what": "reset", "confirm": "yes"},
]


def state() -> dict:
    return {
        "runs": WorkflowRun.objects.count(),
        "events": AuditEvent.objects.count(),
        "faults": list(Fault.objects.values_list("service", "operation", "mode", "remaining")),
        "counts": faults.counts(),
    }


def test_with_the_demo_off_every_method_gets_404_and_nothing_changes(settings, monkeypatch):
    settings.RECOVERY_DEMO = False
    started = []
    monkeypatch.setattr("sandbox.demo.subprocess.Popen", lambda *a, **k: started.append(a))
    faults.set_fault("tasks", "create", "forbidden", times=2)  # a fault a clear would remove
    before = state()
    supervisor = login("supervisor")

    for method in ("get", "head"):
        assert getattr(supervisor, method)("/demo").status_code == 404
        assert getattr(Client(), method)("/demo").status_code == 404  # no login page either: nothing to find
    for data in POSTS:
        response = supervisor.post("/demo", data)
        assert response.status_code == 404, data
    assert Client().post("/demo", POSTS[0]).status_code == 404

    assert state() == before and not started
    page = supervisor.get(reverse("console:runs"))
    assert page.status_code == 200 and 'href="/demo"' not in page.text


def test_with_the_demo_on_a_supervisor_has_the_page_its_link_and_its_actions(settings):
    settings.RECOVERY_DEMO = True
    supervisor = login("supervisor")
    assert 'href="/demo"' in supervisor.get(reverse("console:runs")).text
    assert supervisor.get("/demo").status_code == 200
    armed = supervisor.post("/demo", POSTS[0])
    assert armed.status_code == 200 and "armed forbidden on ledger post" in armed.text
    assert Fault.objects.get().remaining == 100000
    assert 'href="/demo"' not in login("operator").get(reverse("console:runs")).text  # supervisors only, as before


def test_seed_demo_with_the_demo_off_refuses_in_one_line_and_writes_nothing(settings):
    settings.RECOVERY_DEMO, settings.DEBUG = False, False  # production; a bare seed_demo still works under DEBUG
    with pytest.raises(CommandError) as refused:
        call_command("seed_demo", stdout=StringIO(), stderr=StringIO())
    assert "\n" not in str(refused.value) and "RECOVERY_DEMO" in str(refused.value)
    assert "--allow-outside-demo" in str(refused.value)
    assert not WorkflowRun.objects.exists() and not get_user_model().objects.exists()


def test_seed_demo_with_the_demo_off_seeds_on_purpose_with_its_flag(settings):
    """Past the gate: the seed's own checks answer (here, a fault it did not arm refuses it),
    without playing the whole demo in this test."""
    settings.RECOVERY_DEMO = False
    faults.set_fault("tasks", "create", "forbidden", times=3)
    with pytest.raises(CommandError, match="1 armed fault"):
        call_command("seed_demo", "--allow-outside-demo", "--sandbox-url", "http://127.0.0.1:9", stdout=StringIO())
    assert not WorkflowRun.objects.exists()


def test_check_deploy_warns_when_a_production_deployment_has_the_demo_on(settings):
    settings.DEBUG = False
    settings.RECOVERY_DEMO = True
    warned = [m for m in run_checks(include_deployment_checks=True) if m.id == "sandbox.W001"]
    assert len(warned) == 1 and "RECOVERY_DEMO is on with DJANGO_DEBUG off" in warned[0].msg
    assert not [m for m in run_checks() if m.id == "sandbox.W001"]  # a deployment check only
    settings.RECOVERY_DEMO = False
    assert not [m for m in run_checks(include_deployment_checks=True) if m.id == "sandbox.W001"]
