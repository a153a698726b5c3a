"""Calling the simulated systems as their clients do (the ``api`` fixture: a client with the
sandbox key), and the bodies the sandbox tests send."""

import json
from io import StringIO

import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import Client

TASK = {"title": "Approve inv-1847", "assignee": "alice", "payload": {"invoice": "inv-1847", "amount": 120}}


ENTRY = {"reference": "inv-1847", "amount": "123.45", "currency": "EUR", "account": "6000", "memo": "chairs"}


def adapter_client() -> Client:
    """A caller with the sandbox's API key, as the adapters are."""
    return Client(headers={"Authorization": f"Bearer {settings.SANDBOX_API_KEY}"})


@pytest.fixture
def api() -> Client:
    return adapter_client()


def post(api: Client, url: str, body, **headers):
    return api.post(url, data=json.dumps(body), content_type="application/json", headers=headers)


def create_task(api: Client, key: str = "key-1", body: dict = TASK):
    return post(api, "/sandbox/tasks/", body, **{"Idempotency-Key": key})


def send(api: Client, text: str = "please approve inv-1847", client_ref: str = "ref-1", **headers):
    return post(api, "/sandbox/messages/", {"to": "alice", "text": text, "client_ref": client_ref}, **headers)


def post_entry(api: Client, **changes):
    return post(api, "/sandbox/ledger/entries/", {**ENTRY, **changes})


def run_sandbox(*args, **kwargs) -> str:
    out = StringIO()
    call_command("sandbox", *args, stdout=out, stderr=StringIO(), **kwargs)
    return out.getvalue().strip()
