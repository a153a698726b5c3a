"""Traces (OpenTelemetry): off unless ``RECOVERY_TRACING=1`` and ``opentelemetry-api`` is installed
(``pip install -e '.[otel]'``).

One span per run advance (``advance run``) and per step attempt (``step <name>``), with the
attributes of OpenTelemetry's workflow conventions: ``workflow.id``, ``workflow.name``,
``workflow.step.name``, ``workflow.step.attempt``, ``workflow.step.outcome`` and ``error.type``.

The trace a run belongs to is the one its start was part of: ``run_start`` keeps the W3C
``traceparent`` of the span current when the run was started (the event API's request, under
``opentelemetry-instrumentation-django``), and every advance of the run — in whichever process,
Celery worker or embedded executor, however much later — continues that trace. With
``opentelemetry-instrumentation-celery`` installed, the Celery tasks get their spans too
(``recovery.apps`` wires both instrumentations when tracing is on).

Where the spans go is the OpenTelemetry SDK's business: ``configure()`` installs a tracer provider
that exports with OTLP when ``opentelemetry-exporter-otlp`` is installed (``OTEL_EXPORTER_OTLP_*``
settings), unless one is installed already (``opentelemetry-instrument``, or a test's)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from django.conf import settings

try:
    from opentelemetry import propagate, trace
except ImportError:  # the optional dependency is not installed: no tracing
    propagate = trace = None

TRACER = "recovery"


def enabled() -> bool:
    return trace is not None and settings.RECOVERY_TRACING


def traceparent() -> str:
    """The current span's context as a W3C ``traceparent`` ("" when tracing is off or no span is current)."""
    if not enabled():
        return ""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


@contextmanager
def span(name: str, *, parent: str = "", attributes: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """A span named ``name`` for the block, child of ``parent`` (a ``traceparent``) when given,
    else of the current span. Yields None when tracing is off."""
    if not enabled():
        yield None
        return
    context = None
    if parent:
        stored = trace.get_current_span(propagate.extract({"traceparent": parent})).get_span_context()
        current = trace.get_current_span().get_span_context()
        if not (current.is_valid and current.trace_id == stored.trace_id):  # else: already inside it
            context = propagate.extract({"traceparent": parent})
    with trace.get_tracer(TRACER).start_as_current_span(name, context=context, attributes=attributes) as started:
        yield started


def annotate(attributes: Mapping[str, Any]) -> None:
    """Set attributes on the current span (a step's outcome, its error's kind), if one records;
    None values are left out."""
    if not enabled():
        return
    current = trace.get_current_span()
    if current.is_recording():
        current.set_attributes({k: v for k, v in attributes.items() if v is not None})


def configure() -> None:
    """Install a tracer provider that exports spans, unless one is installed already."""
    if not enabled():
        return
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        return  # the API alone: spans go wherever the application's own provider sends them
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    provider = TracerProvider(resource=Resource.create({"service.name": settings.RECOVERY_TRACING_SERVICE}))
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        OTLPSpanExporter = None  # noqa: N806 - the class, when installed
    if OTLPSpanExporter is not None:
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def instrument() -> None:
    """Wire Django's and Celery's instrumentations when they are installed and tracing is on."""
    if not enabled():
        return
    try:
        from opentelemetry.instrumentation.django import DjangoInstrumentor

        if not DjangoInstrumentor().is_instrumented_by_opentelemetry:
            DjangoInstrumentor().instrument()
    except ImportError:
        pass
    try:
        from opentelemetry.instrumentation.celery import CeleryInstrumentor

        if not CeleryInstrumentor().is_instrumented_by_opentelemetry:
            CeleryInstrumentor().instrument()
    except ImportError:
        pass
