"""Model providers: the rules default and the OpenAI-compatible client against a local stub.

No database and no network beyond 127.0.0.1: the stub is a real HTTP server on a free port
whose replies each test scripts and which records the requests it received.
"""

from __future__ import annotations

import json
import logging
import socket
import traceback
from decimal import Decimal

import pydantic
import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from recovery.errors import ErrorKind, InvalidModelOutput, PermanentError, RateLimited, StepError, TransientError
from tests.support.model_server import API_KEY, VALID_DECISION, Reply, completion
from workflows.dispute.agent import RulesAgent, get_agent_provider
from workflows.integrations.openai import RETRYABLE_STATUSES, OpenAIClient, classify_openai_error
from workflows.invoice.model import (
    InvoiceDecision,
    ModelProvider,
    OpenAIProvider,
    RulesProvider,
    decision_json_schema,
    get_provider,
)

# --- The stub server ----------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def validates_like_the_engine(text: str) -> InvoiceDecision:
    """The engine's path (json.loads, then model_validate) and the JSON path must agree."""
    decision = InvoiceDecision.model_validate_json(text)
    assert InvoiceDecision.model_validate(json.loads(text)) == decision
    return decision


# --- The schema ---------------------------------------------------------------------------


def test_the_request_schema_is_strict_mode_compatible_and_describes_every_field():
    schema = decision_json_schema()
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    assert sorted(schema["required"]) == sorted(schema["properties"]) == sorted(InvoiceDecision.model_fields)
    unsupported = {"minLength", "maxLength", "default", "format", "anyOf"}
    for prop in schema["properties"].values():
        assert not unsupported & prop.keys()
    assert schema["properties"]["category"]["enum"] == [
        "office_supplies",
        "software",
        "hardware",
        "travel",
        "services",
        "other",
    ]


def test_the_schema_helper_returns_a_fresh_copy_each_time():
    decision_json_schema()["properties"].clear()
    assert decision_json_schema()["properties"]


@pytest.mark.parametrize("amount", ['"1840.00"', "1840.00", "1840", '"0"', "0.5", '"9999999999.99"'])
def test_an_amount_is_accepted_as_a_decimal_string_or_a_number(amount):
    text = json.dumps({**VALID_DECISION, "amount": "X"}).replace('"X"', amount)
    assert validates_like_the_engine(text).amount == Decimal(json.loads(amount))


@pytest.mark.parametrize(
    "change",
    [
        {"category": "bribes"},
        {"amount": "-1.00"},
        {"amount": -5},
        {"amount": "1.005"},
        {"amount": "12345678901.00"},
        {"currency": "eur"},
        {"currency": "EURO"},
        {"approver": ""},
        {"approver": "a" * 101},
        {"confidence": 1.5},
        {"rationale": "x" * 501},
        {"extra": "field"},
    ],
)
def test_a_decision_outside_the_schema_is_refused(change):
    with pytest.raises(pydantic.ValidationError):
        InvoiceDecision.model_validate_json(json.dumps({**VALID_DECISION, **change}))


def test_a_decision_missing_a_field_is_refused():
    incomplete = {k: v for k, v in VALID_DECISION.items() if k != "approver"}
    with pytest.raises(pydantic.ValidationError):
        InvoiceDecision.model_validate_json(json.dumps(incomplete))


# --- The OpenAI-compatible client ---------------------------------------------------------


def test_a_valid_structured_reply_is_returned_as_text_and_validates(stub):
    content = json.dumps(VALID_DECISION)
    stub.reply(Reply(body=completion(content)))
    output = stub.provider().propose(invoice_id="inv-1847", text="2 laptops, total EUR 1,840.00")
    assert output == content
    assert validates_like_the_engine(output).category == "hardware"


def test_the_request_carries_the_model_the_bearer_token_and_a_strict_json_schema(stub):
    stub.reply(Reply(body=completion(json.dumps(VALID_DECISION))))
    stub.provider(model="my-model").propose(invoice_id="inv-1847", text="2 laptops, total EUR 1,840.00")
    [request] = stub.requests
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == f"Bearer {API_KEY}"
    assert request.headers["content-type"] == "application/json"
    body = request.body
    assert body["model"] == "my-model"
    assert body["temperature"] == 0
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["strict"] is True
    assert body["response_format"]["json_schema"]["name"] == "invoice_decision"
    assert body["response_format"]["json_schema"]["schema"] == decision_json_schema()
    system, user = body["messages"]
    assert system["role"] == "system" and "office_supplies" in system["content"]
    assert user["role"] == "user" and "inv-1847" in user["content"] and "EUR 1,840.00" in user["content"]


def test_an_empty_api_key_sends_no_authorization_header(stub):
    stub.reply(Reply(body=completion(json.dumps(VALID_DECISION))))
    stub.provider(api_key="").propose(invoice_id="inv-1", text="laptop EUR 10")
    assert "authorization" not in stub.requests[0].headers


def test_malformed_json_content_is_returned_as_text_for_the_engine_to_refuse(stub):
    stub.reply(Reply(body=completion("{not json")))
    output = stub.provider().propose(invoice_id="inv-1", text="laptop")
    assert output == "{not json"
    with pytest.raises(pydantic.ValidationError):
        InvoiceDecision.model_validate_json(output)


def test_a_schema_invalid_reply_is_returned_and_fails_validation(stub):
    stub.reply(Reply(body=completion(json.dumps({**VALID_DECISION, "category": "bribes", "amount": "-5.00"}))))
    output = stub.provider().propose(invoice_id="inv-1", text="laptop")
    with pytest.raises(pydantic.ValidationError) as info:
        InvoiceDecision.model_validate_json(output)
    assert {e["loc"][0] for e in info.value.errors()} == {"category", "amount"}


def test_a_429_with_retry_after_is_rate_limited_with_that_delay(stub):
    stub.reply(Reply(status=429, headers={"Retry-After": "3"}, body={"error": {"message": "slow down"}}))
    with pytest.raises(RateLimited) as info:
        stub.provider().propose(invoice_id="inv-1", text="laptop")
    assert info.value.kind == ErrorKind.RATE_LIMITED
    assert info.value.retry_after == 3.0
    assert isinstance(info.value.__cause__, Exception)


def test_a_429_without_retry_after_is_rate_limited_with_no_delay(stub):
    stub.reply(Reply(status=429, body={"error": {"message": "slow down"}}))
    with pytest.raises(RateLimited) as info:
        stub.provider().propose(invoice_id="inv-1", text="laptop")
    assert info.value.retry_after is None


def test_a_reply_slower_than_the_client_timeout_is_transient(stub):
    stub.reply(Reply(body=completion(json.dumps(VALID_DECISION)), delay=3.0))
    with pytest.raises(TransientError) as info:
        stub.provider(timeout=0.3).propose(invoice_id="inv-1", text="laptop")
    assert "timed out" in str(info.value)


def test_the_client_timeout_connects_within_five_seconds_and_reads_within_the_configured_timeout():
    provider = OpenAIProvider(base_url="http://127.0.0.1:9/v1", api_key="", model="m", timeout=30)
    timeout = provider.http_timeout()
    assert timeout.connect == 5.0 and timeout.read == 30


@pytest.mark.parametrize("status", [401, 403])
def test_an_authorisation_failure_is_permanent(stub, status):
    stub.reply(Reply(status=status, body={"error": {"message": "Incorrect API key provided"}}))
    with pytest.raises(PermanentError, match="authorisation"):
        stub.provider().propose(invoice_id="inv-1", text="laptop")


@pytest.mark.parametrize("status", [400, 404, 422])
def test_a_bad_request_or_unknown_model_is_permanent(stub, status):
    stub.reply(Reply(status=status, body={"error": {"message": "The model `nope` does not exist"}}))
    with pytest.raises(PermanentError, match="does not exist"):
        stub.provider().propose(invoice_id="inv-1", text="laptop")


@pytest.mark.parametrize("status", [500, 502, 503, 504, 599])
def test_a_server_error_is_transient(stub, status):
    stub.reply(Reply(status=status, body="upstream overloaded"))
    with pytest.raises(TransientError) as info:
        stub.provider().propose(invoice_id="inv-1", text="laptop")
    assert str(status) in str(info.value)


def test_the_retryable_statuses_are_the_transient_server_side_ones():
    assert {500, 502, 503, 504} <= RETRYABLE_STATUSES
    assert not {400, 401, 403, 404, 422, 429} & RETRYABLE_STATUSES


def test_a_200_with_a_body_that_is_not_json_is_an_invalid_output_carrying_the_body(stub):
    stub.reply(Reply(body="<html>proxy error page</html>"))
    with pytest.raises(InvalidModelOutput) as info:
        stub.provider().propose(invoice_id="inv-1", text="laptop")
    assert info.value.raw_output == "<html>proxy error page</html>"
    assert info.value.kind == ErrorKind.INVALID_MODEL_OUTPUT


def test_the_raw_body_kept_on_an_invalid_output_is_truncated(stub):
    stub.reply(Reply(body="x" * 50_000))
    with pytest.raises(InvalidModelOutput) as info:
        stub.provider().propose(invoice_id="inv-1", text="laptop")
    assert info.value.raw_output == "x" * 20_000


@pytest.mark.parametrize("body", [{"choices": []}, {"choices": [{"message": {"content": None}}]}, {"object": "x"}, []])
def test_a_200_without_message_content_is_an_invalid_output(stub, body):
    stub.reply(Reply(body=json.dumps(body)))
    with pytest.raises(InvalidModelOutput) as info:
        stub.provider().propose(invoice_id="inv-1", text="laptop")
    assert info.value.raw_output == json.dumps(body)


def test_a_model_refusal_is_permanent(stub):
    stub.reply(Reply(body=completion(None, refusal="I can't help with that.")))
    with pytest.raises(PermanentError, match="model refused: I can't help with that."):
        stub.provider().propose(invoice_id="inv-1", text="laptop")


def test_a_refused_connection_is_transient():
    provider = OpenAIProvider(
        base_url=f"http://127.0.0.1:{closed_port()}/v1", api_key=API_KEY, model="gpt-test", timeout=1.0
    )
    with pytest.raises(TransientError, match="unreachable"):
        provider.propose(invoice_id="inv-1", text="laptop")


def test_an_unsupported_url_scheme_is_permanent():
    provider = OpenAIProvider(base_url="ftp://127.0.0.1/v1", api_key=API_KEY, model="gpt-test", timeout=1.0)
    with pytest.raises(PermanentError):
        provider.propose(invoice_id="inv-1", text="laptop")


def test_an_already_classified_or_foreign_error_is_not_reclassified_as_transient():
    original = PermanentError("no")
    assert classify_openai_error(original) is original
    assert classify_openai_error(ValueError("boom")).kind == ErrorKind.UNCLASSIFIED


def echo(text: str) -> str:
    return f"{text} (key {API_KEY})"


LEAKY_REPLIES = {
    "401": Reply(status=401, body={"error": {"message": echo("Incorrect API key provided")}}),
    "403": Reply(status=403, body=echo("forbidden")),
    "400": Reply(status=400, body={"error": echo("bad request")}),
    "429": Reply(status=429, headers={"Retry-After": "1"}, body={"error": {"message": echo("rate limited")}}),
    "503": Reply(status=503, body=echo("unavailable")),
    "non-json 200": Reply(body=echo("<html>not json</html>")),
    "no content": Reply(body=json.dumps({"choices": [], "debug": echo("x")})),
    "refusal": Reply(body=completion(None, refusal=echo("refused"))),
    "timeout": Reply(body=completion("{}"), delay=3.0),
}


@pytest.mark.parametrize("case", sorted(LEAKY_REPLIES))
def test_the_api_key_never_appears_in_an_error_a_log_line_or_a_traceback(stub, caplog, case):
    stub.reply(LEAKY_REPLIES[case])
    provider = stub.provider(timeout=0.3)
    with caplog.at_level(logging.DEBUG), pytest.raises(StepError) as info:
        provider.propose(invoice_id="inv-1", text="laptop")
    error = info.value
    assert stub.requests[0].headers["authorization"] == f"Bearer {API_KEY}"  # the key was sent…
    visible = [str(error), repr(error), error.message, error.raw_output or "", caplog.text, repr(provider)]
    visible.append("".join(traceback.format_exception(error)))
    for text in visible:  # …and shows nowhere
        assert API_KEY not in text


def test_the_api_key_never_appears_when_the_connection_is_refused(caplog):
    provider = OpenAIProvider(base_url=f"http://127.0.0.1:{closed_port()}/v1", api_key=API_KEY, model="m", timeout=1)
    with caplog.at_level(logging.DEBUG), pytest.raises(TransientError) as info:
        provider.propose(invoice_id="inv-1", text="laptop")
    for text in (str(info.value), repr(info.value), caplog.text, "".join(traceback.format_exception(info.value))):
        assert API_KEY not in text


@pytest.mark.parametrize("case", sorted(LEAKY_REPLIES))
def test_a_chat_turn_that_fails_shows_the_api_key_nowhere_either(stub, caplog, case):
    stub.reply(LEAKY_REPLIES[case])
    client = stub.client(timeout=0.3)
    with caplog.at_level(logging.DEBUG), pytest.raises(StepError) as info:
        client.chat(messages=[{"role": "user", "content": "hi"}], tools=[], about="dispute_id=d-1")
    error = info.value
    assert len(stub.requests) == 1 and stub.requests[0].headers["authorization"] == f"Bearer {API_KEY}"
    visible = [str(error), repr(error), error.message, error.raw_output or "", caplog.text, repr(client)]
    visible.append("".join(traceback.format_exception(error)))
    for text in visible:
        assert API_KEY not in text


def test_a_chat_turn_sends_the_tools_and_returns_the_assistant_message_with_its_tool_calls(stub):
    call = {"id": "call_1", "type": "function", "function": {"name": "look_up", "arguments": '{"invoice_id": "i-1"}'}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    stub.reply(Reply(body={**completion(None), "choices": [{"index": 0, "message": message}]}))
    tools = [{"type": "function", "function": {"name": "look_up", "parameters": {"type": "object"}}}]
    answer = stub.client(model="my-model").chat(
        messages=[{"role": "user", "content": "hi"}], tools=tools, about="dispute_id=d-1"
    )
    assert answer == message
    [request] = stub.requests
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == f"Bearer {API_KEY}"
    body = request.body
    assert (body["model"], body["temperature"], body["tools"], body["tool_choice"]) == ("my-model", 0, tools, "auto")
    assert body["messages"] == [{"role": "user", "content": "hi"}]


def test_the_api_key_is_not_returned_even_if_the_server_echoes_it(stub):
    stub.reply(Reply(body=completion(json.dumps({**VALID_DECISION, "rationale": echo("leak")}))))
    output = stub.provider().propose(invoice_id="inv-1", text="laptop")
    assert API_KEY not in output
    validates_like_the_engine(output)


# --- The rules provider -------------------------------------------------------------------

INVOICES = [
    ("Invoice INV-1847 dated 2024-03-05: 2 laptops, total EUR 1,840.00", "hardware", "1840.00", "EUR"),
    ("Rechnung 17.04.2024 — Monitor 27'' — Betrag: 1.840,00 €", "hardware", "1840.00", "EUR"),
    ("Annual SaaS subscription, 12 seats: $4,800.00", "software", "4800.00", "USD"),
    ("Hotel in Lyon, 3 nights, total 612.40 EUR, plus taxi", "travel", "612.40", "EUR"),
    ("Legal consulting retainer Q3: GBP 25,000.00", "services", "25000.00", "GBP"),
    ("Paper, pens and toner for the office: 84,50 EUR", "office_supplies", "84.50", "EUR"),
    ("Misc. charges, amount due 120", "other", "120.00", "EUR"),
    ("Catering for 40 people", "other", "0.00", "EUR"),
    ("", "other", "0.00", "EUR"),
]


@pytest.mark.parametrize(("text", "category", "amount", "currency"), INVOICES)
def test_the_rules_read_category_amount_and_currency_from_realistic_invoices(text, category, amount, currency):
    decision = validates_like_the_engine(RulesProvider().propose(invoice_id="inv-1", text=text))
    assert (decision.category, decision.amount, decision.currency) == (category, Decimal(amount), currency)
    assert 0.5 <= decision.confidence <= 0.99
    assert amount in decision.rationale


@pytest.mark.parametrize(("text", "category", "amount", "currency"), INVOICES)
def test_the_rules_are_deterministic_byte_for_byte(text, category, amount, currency):
    first = RulesProvider().propose(invoice_id="inv-1", text=text)
    assert RulesProvider().propose(invoice_id="inv-2", text=text) == first
    assert first == json.dumps(json.loads(first), sort_keys=True)


def test_the_rules_route_approval_by_amount_then_category():
    def approver(text: str) -> str:
        return json.loads(RulesProvider().propose(invoice_id="i", text=text))["approver"]

    assert approver("laptop EUR 12,000.00") == "cfo@example.com"
    assert approver("laptop EUR 10,000.00") == "it-lead@example.com"
    assert approver("flight EUR 300.00") == "travel-desk@example.com"
    assert approver("licence EUR 300.00") == "finance@example.com"
    assert approver("no keyword EUR 300.00") == "finance@example.com"


def test_more_evidence_gives_the_rules_more_confidence():
    def confidence(text: str) -> float:
        return json.loads(RulesProvider().propose(invoice_id="i", text=text))["confidence"]

    assert confidence("nothing here") == 0.5
    assert confidence("nothing here") < confidence("laptop") < confidence("laptop EUR 10.00")
    assert confidence("laptop EUR 10.00") < confidence("laptop and monitor, EUR 10.00") <= 0.99


@hypothesis_settings(max_examples=300, deadline=None)
@given(st.text(max_size=300) | st.from_regex(r"[A-Za-z €$£¥.,'0-9-]{0,80}", fullmatch=True))
def test_the_rules_output_for_any_text_is_json_that_validates(text):
    output = RulesProvider().propose(invoice_id="inv-x", text=text)
    decision = validates_like_the_engine(output)
    assert decision.category in {"office_supplies", "software", "hardware", "travel", "services", "other"}
    assert output == RulesProvider().propose(invoice_id="inv-x", text=text)


# --- Configuration ------------------------------------------------------------------------


def test_get_provider_gives_the_rules_by_default(settings):
    settings.MODEL_PROVIDER = "rules"
    provider = get_provider()
    assert isinstance(provider, RulesProvider) and isinstance(provider, ModelProvider)
    assert provider.name == "rules"


def test_the_scripted_provider_answers_its_invoices_from_the_script_and_the_rest_by_the_rules(settings, tmp_path):
    script = tmp_path / "script.json"
    off_schema = '{"category": "bribes", "amount": "146.80"}'
    script.write_text(json.dumps({"IN-5532": off_schema}))
    settings.MODEL_PROVIDER, settings.MODEL_SCRIPT = "scripted", str(script)
    provider = get_provider()
    assert provider.name == "scripted" and isinstance(provider, ModelProvider)
    assert provider.propose(invoice_id="IN-5532", text="taxi receipts EUR 146.80") == off_schema
    text = "40 ergonomic chairs. Total due EUR 1,840.00"
    assert provider.propose(invoice_id="inv-1", text=text) == RulesProvider().propose(invoice_id="inv-1", text=text)


@pytest.mark.parametrize("content", [None, "not json", '["a list"]', '{"IN-1": {"category": "x"}}'])
def test_a_missing_or_malformed_model_script_is_a_permanent_error_that_names_it(settings, tmp_path, content):
    script = tmp_path / "script.json"
    if content is not None:
        script.write_text(content)
    settings.MODEL_PROVIDER, settings.MODEL_SCRIPT = "scripted", str(script)
    with pytest.raises(PermanentError, match="MODEL_SCRIPT"):
        get_provider()


def test_get_provider_builds_the_openai_client_from_settings_without_showing_the_key(settings):
    settings.MODEL_PROVIDER = "openai"
    settings.OPENAI_BASE_URL = "http://127.0.0.1:1/v1/"
    settings.OPENAI_API_KEY = API_KEY
    settings.OPENAI_MODEL = "gpt-configured"
    settings.OPENAI_TIMEOUT = 7.5
    provider = get_provider()
    assert isinstance(provider, OpenAIProvider) and isinstance(provider, ModelProvider)
    assert (provider.name, provider.base_url, provider.model, provider.timeout) == (
        "openai",
        "http://127.0.0.1:1/v1",
        "gpt-configured",
        7.5,
    )
    assert provider.api_key == API_KEY and API_KEY not in repr(provider)


def test_get_provider_defaults_the_openai_base_url(settings):
    settings.MODEL_PROVIDER = "openai"
    del settings.OPENAI_BASE_URL
    assert get_provider().base_url == "https://api.openai.com/v1"


def test_the_invoice_s_openai_provider_is_the_shared_client_and_both_read_the_same_settings(settings):
    settings.MODEL_PROVIDER = "openai"
    settings.OPENAI_BASE_URL = "http://127.0.0.1:1/v1/"
    settings.OPENAI_API_KEY = API_KEY
    settings.OPENAI_MODEL = "gpt-configured"
    settings.OPENAI_TIMEOUT = 7.5
    provider, client = get_provider(), OpenAIClient.from_settings()
    assert isinstance(provider, OpenAIClient)
    fields = ("name", "base_url", "api_key", "model", "timeout")
    assert [getattr(provider, f) for f in fields] == [getattr(client, f) for f in fields]
    assert API_KEY not in repr(client)


def test_the_dispute_agent_is_the_rules_offline_and_the_shared_client_with_openai(settings):
    for kind in ("rules", "scripted"):
        settings.MODEL_PROVIDER = kind
        assert isinstance(get_agent_provider(), RulesAgent)
    settings.MODEL_PROVIDER, settings.OPENAI_BASE_URL = "openai", "http://127.0.0.1:1/v1"
    settings.OPENAI_API_KEY = API_KEY
    agent = get_agent_provider()
    assert type(agent) is OpenAIClient and agent.base_url == "http://127.0.0.1:1/v1" and agent.api_key == API_KEY
    assert API_KEY not in repr(agent)
    settings.MODEL_PROVIDER = "oracle"
    with pytest.raises(PermanentError, match="MODEL_PROVIDER"):
        get_agent_provider()


def test_the_configured_openai_provider_talks_to_a_compatible_server(stub, settings):
    settings.MODEL_PROVIDER = "openai"
    settings.OPENAI_BASE_URL = stub.base_url
    settings.OPENAI_API_KEY = ""
    settings.OPENAI_MODEL = "local-model"
    stub.reply(Reply(body=completion(json.dumps(VALID_DECISION))))
    assert validates_like_the_engine(get_provider().propose(invoice_id="inv-1", text="laptop")).currency == "EUR"
    assert stub.requests[0].body["model"] == "local-model"
