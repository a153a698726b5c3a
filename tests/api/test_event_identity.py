"""Distinct business events never merge into one run (issue 34, item 1).

The run's input is stored redacted, but its id and the repeat check come from the event as it
was sent: identifiers shaped like credentials were redacted before the id was derived, so
``ASIA2024000000000001`` and ``…0002`` both became ``invoice:ASIA:[REDACTED:aws_access_key]`` and
the second answered "existing" and was never processed."""

import json

import pytest
from django.test import Client

from recovery.api.tokens import issue_token
from recovery.engine import transitions
from recovery.errors import StartConflict
from recovery.models import AuditEvent, StepExecution, WorkflowRun
from recovery.workflow import get_workflow, payload_hash

pytestmark = pytest.mark.django_db

URL = "/api/events/invoice"
TEXT = "ACME Office Supply — 40 ergonomic chairs. Total due: EUR 1,840.00"


@pytest.fixture
def token() -> str:
    return issue_token(name="erp", workflow_name="invoice")[1]


def post(body, token):
    return Client().post(URL, data=json.dumps(body), content_type="application/json",
                         headers={"Authorization": f"Bearer {token}"})  # fmt: skip


def counts() -> tuple[int, int, int]:
    return WorkflowRun.objects.count(), StepExecution.objects.count(), AuditEvent.objects.count()


@pytest.mark.parametrize(
    "first, second",
    [
        ("ASIA2024000000000001", "ASIA2024000000000002"),  # an AWS access key id's shape
        ("sk-INVOICE-2026-000000000007", "sk-INVOICE-2026-000000000008"),  # an OpenAI key's shape
    ],
)
def test_identifiers_shaped_like_credentials_are_refused_never_merged(token, first, second):
    for invoice_id in (first, second, first):
        response = post({"tenant": "ASIA", "invoice_id": invoice_id, "text": TEXT}, token)
        assert response.status_code == 400, response.content
        error = response.json()["error"]
        assert "look like a credential" in error and "would merge" in error
        assert invoice_id not in error  # the refusal does not echo what may be a secret
        assert response.json().get("created") is None
    assert counts() == (0, 0, 0)


def test_the_same_identifier_with_another_secret_is_a_conflict_not_a_repeat(token):
    # The two events differ only in what redaction hides: their stored inputs are equal, and the
    # plain hash of the redacted input called the second a repeat of the first.
    event = {"tenant": "t1", "invoice_id": "inv-7", "text": TEXT, "password": "first-secret-value"}
    created = post(event, token)
    assert created.status_code == 201, created.content
    run = WorkflowRun.objects.get()
    assert run.input["password"] == "[REDACTED]"
    before = counts()

    again = post(event, token)
    assert (again.status_code, again.json()["created"]) == (200, False)
    other = post({**event, "password": "second-secret-value"}, token)
    assert other.status_code == 409, other.content
    assert "different input" in other.json()["error"]
    assert counts() == before


def test_no_plain_hash_of_a_credential_is_stored(token):
    event = {"tenant": "t1", "invoice_id": "inv-8", "text": TEXT, "password": "hunter2-but-longer"}
    assert post(event, token).status_code == 201
    run = WorkflowRun.objects.get()
    raw = get_workflow("invoice").validate_input(event)
    assert raw["password"] == "hunter2-but-longer" != run.input["password"]
    assert run.input_hash not in {payload_hash(raw), payload_hash(run.input)}  # a plain hash can be guessed
    assert len(run.input_hash) == 64


def test_a_repeat_still_finds_its_run_after_the_secret_key_is_rotated(settings):
    event = {"tenant": "t1", "invoice_id": "inv-9", "text": TEXT}
    run, created = transitions.run_start(workflow="invoice", data=event)
    assert created
    old = settings.SECRET_KEY
    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = "a-new-key-" + "x" * 50, [old]
    assert transitions.run_start(workflow="invoice", data=event) == (run, False)
    settings.SECRET_KEY_FALLBACKS = []  # the old key dropped: the repeat can no longer be told
    with pytest.raises(StartConflict):
        transitions.run_start(workflow="invoice", data=event)
    assert WorkflowRun.objects.count() == 1


def test_a_run_started_before_keyed_hashes_is_still_found_by_its_repeat():
    event = {"tenant": "t1", "invoice_id": "inv-10", "text": TEXT}
    run, _ = transitions.run_start(workflow="invoice", data=event)
    WorkflowRun.objects.filter(pk=run.pk).update(input_hash=payload_hash(run.input))  # as stored before
    assert transitions.run_start(workflow="invoice", data=event) == (run, False)
    with pytest.raises(StartConflict):
        transitions.run_start(workflow="invoice", data={**event, "text": TEXT + " and a desk"})


def test_a_batch_tells_events_apart_by_what_was_sent():
    event = {"tenant": "t1", "invoice_id": "inv-11", "text": TEXT, "api_key": "k-aaaaaaaaaaaa"}
    results = transitions.run_start_many(
        workflow="invoice",
        events=[event, {**event, "api_key": "k-bbbbbbbbbbbb"}, event, {**event, "invoice_id": "ASIA2024000000000003"}],
    )
    assert [r.outcome for r in results] == ["created", "conflict", "existing", "invalid"]
    assert "look like a credential" in results[3].error
    assert WorkflowRun.objects.count() == 1
