"""The event ingestion API (docs/operating.md "Event API") and the commands that manage its tokens and the
console's users. A business event starts one run however often it is delivered (rule 1:
the workflow id comes from the event); every refused request writes nothing."""

import hashlib
import json
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management import CommandError, call_command
from django.test import Client

from recovery import registry
from recovery.api.tokens import issue_token
from recovery.api.views import MAX_BODY_BYTES
from recovery.models import ApiToken, AuditEvent, StepExecution, WorkflowRun
from recovery.workflow import Workflow

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])

URL = "/api/events/invoice"
EVENT = {
    "tenant": "tenant-42",
    "invoice_id": "inv-1847",
    "vendor": "ACME Office Supply",
    "text": "ACME Office Supply — 40 ergonomic chairs and 10 desks. Total due: EUR 1,840.00",
}


@pytest.fixture
def token() -> str:
    return issue_token(name="erp", workflow_name="invoice")[1]


@pytest.fixture
def scratch_workflow():
    wf = Workflow("scratch_api", version=1, workflow_id=lambda i: f"scratch:{i['id']}")
    yield wf
    registry._REGISTRY.pop("scratch_api", None)


def post(body, *, token: str | None = None, url: str = URL, client: Client | None = None, **headers):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return (client or Client()).post(url, data=data, content_type="application/json", headers=headers)


def nothing_written() -> bool:
    return not WorkflowRun.objects.exists() and not StepExecution.objects.exists() and not AuditEvent.objects.exists()


def run_cmd(*args) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue().strip()


# --- starting runs ------------------------------------------------------------------------


def test_an_event_starts_one_run_and_its_redelivery_answers_with_the_same_run(token):
    client = Client(enforce_csrf_checks=True)  # token auth, no cookies: CSRF does not apply
    first = post(EVENT, token=token, client=client)
    assert first.status_code == 201
    assert first.json() == {
        "workflow_id": "invoice:tenant-42:inv-1847",
        "version": 3,
        "state": "pending",
        "created": True,
    }

    again = post(EVENT, token=token, client=client)
    assert again.status_code == 200
    assert again.json() == {
        "workflow_id": "invoice:tenant-42:inv-1847",
        "version": 3,
        "state": "pending",
        "created": False,
    }

    run = WorkflowRun.objects.get()
    assert run.input["vendor"] == "ACME Office Supply"  # extra fields of the event are kept
    assert AuditEvent.objects.filter(run=run).count() == 1
    start = AuditEvent.objects.get(run=run)
    assert (start.action, start.actor, start.actor_user) == ("start", "api:erp", None)  # which system sent it
    assert ApiToken.objects.get(name="erp").last_used_at is not None


def test_the_same_workflow_id_with_a_different_input_is_a_conflict_and_changes_nothing(token):
    assert post(EVENT, token=token).status_code == 201
    response = post({**EVENT, "text": "changed: Total due EUR 9,999.00"}, token=token)
    assert response.status_code == 409
    assert "different input" in response.json()["error"]
    assert WorkflowRun.objects.get().input["text"] == EVENT["text"]
    assert AuditEvent.objects.count() == 1


# --- refusals: nothing is written -----------------------------------------------------------


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer", "Bearer rc_not-a-token", "Basic cmM6eA==", "Bearer not-our-format"],
    ids=["missing", "empty", "unknown", "other-scheme", "foreign"],
)
def test_a_request_without_a_valid_token_is_401_and_creates_nothing(token, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    response = post(EVENT, **headers)
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert "error" in response.json()
    assert nothing_written()
    assert ApiToken.objects.get(name="erp").last_used_at is None


def test_a_revoked_token_is_refused_like_an_unknown_one(token):
    assert "revoked: erp" in run_cmd("revoke_api_token", "erp")
    response = post(EVENT, token=token)
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert nothing_written()


def test_a_token_scoped_to_another_workflow_is_403_and_creates_nothing(token, scratch_workflow):
    scratch_token = issue_token(name="scratch", workflow_name="scratch_api")[1]
    response = post(EVENT, token=scratch_token)
    assert response.status_code == 403
    assert "invoice" in response.json()["error"]
    assert post({"id": "1"}, token=token, url="/api/events/scratch_api").status_code == 403
    assert nothing_written()


def test_an_unknown_workflow_is_404(token):
    response = post(EVENT, token=token, url="/api/events/no_such_workflow")
    assert response.status_code == 404
    assert "no_such_workflow" in response.json()["error"]
    assert nothing_written()


@pytest.mark.parametrize(
    "body,message",
    [
        ("{not json", "not valid JSON"),
        ("", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        ('{"tenant": NaN}', "not valid JSON"),
        ("[" * 50_000 + "]" * 50_000, "not valid JSON"),
        ('"an invoice"', "JSON object"),
        ("null", "JSON object"),
    ],
    ids=["syntax", "empty", "not-utf", "nan", "too-deep", "string", "null"],
)
def test_a_body_that_is_not_a_json_object_is_400_and_creates_nothing(token, body, message):
    response = post(body, token=token)
    assert response.status_code == 400
    assert message in response.json()["error"]
    assert nothing_written()


def test_a_batch_answers_each_event_as_it_alone_would_have_been_answered(token):
    first = post(EVENT, token=token).json()["workflow_id"]
    other = {**EVENT, "invoice_id": "INV-2002"}
    response = post(
        [other, EVENT, {**EVENT, "text": "something else, EUR 5.00"}, {"tenant": "acme"}, 42, other], token=token
    )
    assert response.status_code == 207
    results = response.json()["results"]
    assert [(r["index"], r["status"]) for r in results] == [(0, 201), (1, 200), (2, 409), (3, 400), (4, 400), (5, 200)]
    assert results[0]["created"] is True and results[0]["state"] == "pending"
    assert results[1] == {"index": 1, "status": 200, "workflow_id": first, "state": "pending", "created": False}
    assert results[2]["workflow_id"] == first and "different input" in results[2]["error"]
    assert "invoice_id" in results[3]["error"] and results[4]["error"] == "workflow input must be a JSON object"
    assert results[5]["workflow_id"] == results[0]["workflow_id"]
    assert WorkflowRun.objects.count() == 2
    assert AuditEvent.objects.filter(action="start", actor="api:erp").count() == 2


@pytest.mark.parametrize("body", [[], [EVENT] * 1001], ids=["empty", "over-1000"])
def test_a_batch_of_no_event_or_of_too_many_is_400_and_creates_nothing(token, body):
    response = post(body, token=token)
    assert response.status_code == 400 and "a batch is an array of 1 to 1000 events" in response.json()["error"]
    assert nothing_written()


def test_an_event_that_does_not_validate_is_400_with_each_field_and_its_message(token):
    response = post({"tenant": "has spaces", "text": ""}, token=token)
    assert response.status_code == 400
    body = response.json()
    assert set(body["fields"]) == {"tenant", "invoice_id", "text"}
    assert body["fields"]["invoice_id"] == "Field required"
    assert "pattern" in body["fields"]["tenant"]
    assert "at least 1 character" in body["fields"]["text"]
    assert nothing_written()


def test_an_event_over_256_kib_is_refused_before_it_is_parsed(token):
    big = {**EVENT, "text": "x" * MAX_BODY_BYTES}
    response = post(big, token=token)
    assert response.status_code == 413
    assert "256 KiB" in response.json()["error"]
    assert nothing_written()
    just_under = {**EVENT, "attachment": "y" * (MAX_BODY_BYTES - len(json.dumps(EVENT)) - 40)}
    assert len(json.dumps(just_under)) <= MAX_BODY_BYTES
    assert post(just_under, token=token).status_code == 201


@pytest.mark.parametrize("method", ["get", "put", "delete"])
def test_only_post_is_allowed(token, method):
    response = getattr(Client(), method)(URL, headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 405
    assert response["Allow"] == "POST"
    assert nothing_written()


# --- tokens -----------------------------------------------------------------------------------


def test_the_token_is_stored_only_as_its_sha256_and_shown_once_by_the_command():
    token = run_cmd("create_api_token", "erp", "--workflow", "invoice")
    assert token.startswith("rc_") and "\n" not in token and len(token) > 40
    row = ApiToken.objects.get(name="erp")
    assert row.token_hash == hashlib.sha256(token.encode()).hexdigest()
    assert row.prefix == token[:8]
    assert (row.workflow_name, row.revoked_at, row.last_used_at) == ("invoice", None, None)
    stored = [str(getattr(row, f.attname)) for f in ApiToken._meta.concrete_fields]
    assert not any(token in value for value in stored)
    assert post(EVENT, token=token).status_code == 201


@pytest.mark.parametrize(
    "args,message",
    [
        (["erp", "--workflow", "nope"], "unknown workflow 'nope'"),
        (["erp"], "--workflow"),
        (["  ", "--workflow", "invoice"], "needs a name"),
    ],
)
def test_create_api_token_refuses_bad_input_and_writes_nothing(args, message):
    with pytest.raises(CommandError, match=message):
        run_cmd("create_api_token", *args)
    assert not ApiToken.objects.exists()


def test_a_token_name_is_unique_and_revoking_twice_or_an_unknown_name_is_handled():
    first = run_cmd("create_api_token", "erp", "--workflow", "invoice")
    with pytest.raises(CommandError, match="already exists"):
        run_cmd("create_api_token", "erp", "--workflow", "invoice")
    assert ApiToken.objects.count() == 1
    run_cmd("revoke_api_token", "erp")
    at = ApiToken.objects.get().revoked_at
    run_cmd("revoke_api_token", "erp")
    assert ApiToken.objects.get().revoked_at == at
    with pytest.raises(CommandError, match="no API token named 'nope'"):
        run_cmd("revoke_api_token", "nope")
    assert post(EVENT, token=first).status_code == 401


# --- createoperator ------------------------------------------------------------------------------

# Passwords that pass the validators (tests/test_accounts.py tests the refusals).
FIRST, SECOND = "correct horse battery", "staple gun of the night"


def test_createoperator_generates_and_prints_a_password_when_not_on_a_terminal():
    line = run_cmd("createoperator", "olga", "--group", "operator", "--reason", "new on the night shift")
    assert line.startswith("created 'olga' in group operator; password: ")
    password = line.rsplit(" ", 1)[1]
    user = get_user_model().objects.get(username="olga")
    assert user.check_password(password) and user.is_active
    assert list(user.groups.values_list("name", flat=True)) == ["operator"]


def test_createoperator_updates_a_user_into_exactly_one_role_and_keeps_other_groups():
    run_cmd("createoperator", "olga", "--group", "operator", "--password", FIRST, "--reason", "hired")
    user = get_user_model().objects.get(username="olga")
    user.groups.add(Group.objects.create(name="finance"))
    line = run_cmd("createoperator", "olga", "--group", "supervisor", "--password", SECOND, "--reason", "promoted")
    assert line == "updated 'olga' in group supervisor"  # a given password is never printed
    user.refresh_from_db()
    assert user.check_password(SECOND)
    assert sorted(user.groups.values_list("name", flat=True)) == ["finance", "supervisor"]
    assert get_user_model().objects.count() == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["olga", "--group", "admin", "--reason", "r"], "invalid choice"),
        (["olga", "--reason", "r"], "--group"),
        (["olga", "--group", "viewer", "--password", FIRST, "--reason", " "], "reason"),
        (["olga", "--group", "viewer", "--password", "", "--reason", "r"], "must not be empty"),
        (["not a name!", "--group", "viewer", "--password", FIRST, "--reason", "r"], "invalid username"),
    ],
)
def test_createoperator_refuses_bad_input_and_writes_nothing(args, message):
    # Groups another test of this worker left (a transactional test's flush, a data migration's
    # roles) are not this command's: compare before and after, by id and name.
    groups = list(Group.objects.order_by("pk").values_list("pk", "name"))
    with pytest.raises(CommandError, match=message):
        run_cmd("createoperator", *args)
    assert not get_user_model().objects.exists()
    assert list(Group.objects.order_by("pk").values_list("pk", "name")) == groups


def test_a_database_out_of_reach_is_503_with_retry_after_and_the_same_event_later_starts_the_run(token, monkeypatch):
    """A database restart under the API is not a 500: nothing was written, send it again."""
    from django.db import OperationalError

    from recovery.api import views as api

    def down(**kwargs):
        raise OperationalError("terminating connection due to administrator command")

    monkeypatch.setattr(api, "run_start", down)
    response = post(EVENT, token=token)
    assert response.status_code == 503 and response["Retry-After"] == str(api.RETRY_AFTER_SECONDS)
    assert "nothing was written" in response.json()["error"]
    assert nothing_written()
    monkeypatch.undo()
    assert post(EVENT, token=token).status_code == 201
