"""The adapters classify once, at the boundary (rule 8): which statuses retry, which stop,
and when a lost answer means "unknown"."""

import httpx
import pytest

from recovery.errors import ErrorKind, PermanentError, StepError
from workflows.integrations import adapters


def client(handler) -> adapters.SandboxClient:
    return adapters.SandboxClient(base_url="http://sandbox.test", timeout=1.0, transport=httpx.MockTransport(handler))


def responding(status: int, body=None, headers=None):
    return client(lambda request: httpx.Response(status, json=body or {}, headers=headers or {}))


def raising(exc_type):
    def handler(request):
        raise exc_type("boom", request=request)

    return client(handler)


def kind_of(call) -> ErrorKind:
    with pytest.raises(StepError) as info:
        call()
    return info.value.kind


def create(c):
    return lambda: adapters.create_task(key="k", title="t", assignee="a", payload={}, client=c)


@pytest.mark.parametrize(
    "status,kind",
    [
        (429, ErrorKind.RATE_LIMITED),
        (500, ErrorKind.TRANSIENT),
        (502, ErrorKind.TRANSIENT),
        (503, ErrorKind.TRANSIENT),
        (504, ErrorKind.TRANSIENT),
        (400, ErrorKind.PERMANENT),
        (401, ErrorKind.PERMANENT),
        (403, ErrorKind.PERMANENT),
        (404, ErrorKind.PERMANENT),
        (409, ErrorKind.PERMANENT),
        (422, ErrorKind.PERMANENT),
        (418, ErrorKind.UNCLASSIFIED),
    ],
)
def test_each_status_maps_to_one_error_kind(status, kind):
    assert kind_of(create(responding(status, {"error": "x"}))) == kind


def test_only_5xx_and_429_are_retried():
    assert adapters.RETRYABLE_STATUSES == {500, 502, 503, 504}


def test_retry_after_is_read_from_the_header():
    with pytest.raises(StepError) as info:
        create(responding(429, {"error": "slow down"}, {"Retry-After": "12"}))()
    assert info.value.retry_after == 12.0


def test_a_write_whose_answer_is_lost_is_unknown_but_a_connection_refused_never_left():
    assert kind_of(create(raising(httpx.ReadTimeout))) == ErrorKind.UNKNOWN_OUTCOME
    assert kind_of(create(raising(httpx.RemoteProtocolError))) == ErrorKind.UNKNOWN_OUTCOME
    assert kind_of(create(raising(httpx.ConnectError))) == ErrorKind.TRANSIENT
    assert kind_of(create(raising(httpx.ConnectTimeout))) == ErrorKind.TRANSIENT


def test_a_read_whose_answer_is_lost_is_simply_retried():
    assert kind_of(lambda: adapters.find_task(key="k", client=raising(httpx.ReadTimeout))) == ErrorKind.TRANSIENT


def test_the_search_for_open_tasks_is_a_read_sending_its_filters_and_naming_each_tasks_invoice():
    seen = []

    def handler(request):
        seen.append(dict(request.url.params))
        return httpx.Response(200, json={"results": [{"id": "task_3", "payload": {"invoice_id": "inv-1"}}]})

    found = adapters.find_open_tasks(tenant="acme", amount="1840.00", currency="EUR", client=client(handler))
    assert found == [{"task_id": "task_3", "invoice_id": "inv-1"}]
    assert seen == [{"tenant": "acme", "amount": "1840.00", "currency": "EUR"}]
    search = adapters.find_open_tasks
    assert (
        kind_of(lambda: search(tenant="a", amount="1", currency="EUR", client=responding(503))) == ErrorKind.TRANSIENT
    )
    assert (
        kind_of(lambda: search(tenant="a", amount="1", currency="EUR", client=responding(403))) == ErrorKind.PERMANENT
    )
    lost = raising(httpx.ReadTimeout)
    assert kind_of(lambda: search(tenant="a", amount="1", currency="EUR", client=lost)) == ErrorKind.TRANSIENT


def test_the_idempotency_key_is_sent_as_a_header():
    seen = {}

    def handler(request):
        seen.update(request.headers)
        return httpx.Response(201, json={"id": "task_1", "status": "open"})

    outcome = adapters.create_task(key="abc", title="t", assignee="a", payload={}, client=client(handler))
    assert seen["idempotency-key"] == "abc" and outcome.remote_ref == "task_1"


def test_a_duplicate_ledger_reference_returns_our_earlier_posting_or_refuses_a_different_one():
    def handler(request):
        if request.method == "POST":
            return httpx.Response(409, json={"error": "duplicate reference", "existing_id": "le_7"})
        return httpx.Response(200, json={"results": [{"id": "le_7", "reference": "r", "amount": "10.00"}]})

    ours = adapters.post_entry(
        reference="r", amount="10.0", currency="EUR", account="a", memo="", client=client(handler)
    )
    assert ours.remote_ref == "le_7"
    with pytest.raises(PermanentError, match="different posting"):
        adapters.post_entry(reference="r", amount="11.00", currency="EUR", account="a", memo="", client=client(handler))


def test_an_entry_already_reversed_answers_with_that_reversal():
    c = responding(409, {"error": "already reversed", "existing_id": "le_9"})
    assert adapters.reverse_entry(entry_id="le_7", reference="r:rev", memo="", client=c).remote_ref == "le_9"


def test_a_correction_already_sent_is_not_sent_again():
    posts = []

    def handler(request):
        if request.method == "POST":
            posts.append(request)
            return httpx.Response(201, json={"id": "msg_2"})
        return httpx.Response(200, json={"results": [{"id": "msg_2", "to": "x"}]})

    outcome = adapters.send_correction(message_id="msg_1", text="t", client_ref="c", client=client(handler))
    assert outcome.remote_ref == "msg_2" and posts == []
