"""Traces, with the OpenTelemetry SDK's in-memory exporter: a span per run advance and per step
attempt, with the workflow conventions' attributes, in the trace of the event API's request —
whether the run is advanced by the embedded executor or by the Celery task."""

from __future__ import annotations

import pytest
from django.test import Client
from opentelemetry import trace
from opentelemetry.instrumentation.django import DjangoInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from recovery import tasks
from recovery.api import tokens
from recovery.engine.transitions import run_start
from recovery.models import RunState, WorkflowRun
from tests.support import receivers
from tests.support.engine import drive

pytestmark = pytest.mark.django_db

EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans(settings):
    """Tracing on, every finished span in EXPORTER (one SDK provider for the whole session: the
    API lets a process set its provider once)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(provider)
    settings.RECOVERY_TRACING = True
    EXPORTER.clear()
    yield EXPORTER
    EXPORTER.clear()


def started_through_the_api(order_id: str) -> WorkflowRun:
    """POST the event to the API under Django's instrumentation: the request is a server span."""
    _, token = tokens.issue_token(name=f"erp-{order_id}", workflow_name="test_orders")
    DjangoInstrumentor().instrument()
    try:
        response = Client().post(
            "/api/events/test_orders",
            data={"tenant": "t", "order_id": order_id},
            content_type="application/json",
            headers={"Authorization": f"Bearer {token}"},
        )
    finally:
        DjangoInstrumentor().uninstrument()
    assert response.status_code == 201, response.content
    return WorkflowRun.objects.get(workflow_id=response.json()["workflow_id"])


def test_every_advance_and_attempt_is_a_span_in_the_trace_of_the_event_api_request(clock, spans):
    receivers.arm("task", "fail_before_commit")  # create_task's first attempt fails: a retry
    run = started_through_the_api("traced")
    (request,) = [s for s in spans.get_finished_spans() if s.kind == trace.SpanKind.SERVER]
    assert run.traceparent and format(request.context.trace_id, "032x") in run.traceparent

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    finished = spans.get_finished_spans()
    advances = [s for s in finished if s.name == "advance run"]
    attempts = [s for s in finished if s.name.startswith("step ")]
    assert len(advances) >= 2  # the retry waited: the run was advanced again
    assert {s.context.trace_id for s in advances + attempts} == {request.context.trace_id}
    assert all(s.parent.span_id == request.context.span_id for s in advances)
    for span in attempts:
        assert span.parent.span_id in {a.context.span_id for a in advances}
        assert span.attributes["workflow.id"] == run.workflow_id
        assert span.attributes["workflow.name"] == "test_orders"

    create = [s for s in attempts if s.attributes["workflow.step.name"] == "create_task"]
    assert [(s.attributes["workflow.step.outcome"], s.attributes.get("error.type")) for s in create] == [
        ("failed", "transient"),
        ("succeeded", None),
    ]
    assert [s.attributes["workflow.step.attempt"] for s in create] == [0, 1]  # attempts made before it


def test_the_celery_task_continues_the_trace(clock, settings, spans):
    run = started_through_the_api("celery")
    request_trace = spans.get_finished_spans()[-1].context.trace_id
    spans.clear()
    tasks.advance_run.apply(args=[run.pk])  # as a worker runs it: in another process, later
    finished = spans.get_finished_spans()
    assert {s.name for s in finished} >= {"advance run", "step read", "step decide", "step create_task"}
    assert {s.context.trace_id for s in finished if s.name == "advance run" or s.name.startswith("step ")} == {
        request_trace
    }


def test_without_tracing_no_span_is_made_and_no_context_is_kept(clock, settings, spans):
    settings.RECOVERY_TRACING = False
    run, _ = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "untraced"})
    drive(run, clock)
    assert run.traceparent is None and spans.get_finished_spans() == ()


def test_with_tracing_on_django_and_celery_are_instrumented_when_installed(settings):
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    from recovery import tracing

    settings.RECOVERY_TRACING = True
    try:
        tracing.instrument()
        assert DjangoInstrumentor().is_instrumented_by_opentelemetry
        assert CeleryInstrumentor().is_instrumented_by_opentelemetry
    finally:
        DjangoInstrumentor().uninstrument()
        CeleryInstrumentor().uninstrument()
