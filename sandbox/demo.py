"""The demo page (``/demo``): arm a fault in the simulated systems, clear them, or start an
invoice, from the browser. A supervisor's page of the console, served by the sandbox app: the
engine and the console know nothing of the simulated systems."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from recovery.console.views import permission_required, require_methods
from recovery.engine import transitions
from sandbox import faults
from sandbox.models import FAULTABLE, Fault, FaultMode


@require_methods("GET", "HEAD", "POST")
@permission_required("sandbox")
def demo(request: HttpRequest) -> HttpResponse:
    message, status = "", 200
    if request.method == "POST":
        try:
            message = demo_action(request.POST, actor=request.user)
        except ValueError as exc:
            message, status = str(exc), 400
    context = {**demo_context(), "message": message, "error": status != 200}
    return render(request, "sandbox/demo.html", context, status=status)


def demo_context() -> dict[str, Any]:
    return {
        "counts": faults.counts(),
        "armed": list(Fault.objects.using("sandbox").filter(remaining__gt=0).order_by("created_at")),
        "targets": [f"{service} {op}" for service, ops in FAULTABLE.items() for op in ops],
        "modes": FaultMode.values,
    }


def demo_action(data, *, actor: AbstractBaseUser) -> str:
    """Arm a fault, clear the sandbox, or start a demo invoice. Raises ValueError."""
    what = data.get("what")
    if what == "fault":
        service, _, operation = (data.get("target") or "").partition(" ")
        times = _int(data.get("times"), 1)
        faults.set_fault(
            service,
            operation,
            data.get("mode", ""),
            times=times,
            retry_after=_int(data.get("retry_after"), 1),
            delay_ms=_int(data.get("delay_ms"), 0),
        )
        return f"armed {data.get('mode')} on {service} {operation} for the next {times} call(s)"
    if what == "clear":
        if data.get("confirm") != "yes":
            raise ValueError("tick the box to clear: every fault, task, message and ledger entry goes")
        faults.clear()
        return "sandbox cleared: no faults, no tasks, messages or ledger entries"
    if what == "start":
        invoice_id = (data.get("invoice_id") or "").strip()
        text = (data.get("text") or "").strip()
        try:
            run, created = transitions.run_start(
                workflow="invoice", data={"tenant": "demo", "invoice_id": invoice_id, "text": text}, actor=actor
            )
        except Exception as exc:  # pydantic validation, conflicts: shown on the page
            raise ValueError(f"could not start: {exc}") from exc
        return f"{'started' if created else 'already running'}: {run.workflow_id}"
    raise ValueError("unknown demo action")


def _int(value: Any, default: int) -> int:
    try:
        return int(value) if value not in (None, "") else default
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a whole number") from None
