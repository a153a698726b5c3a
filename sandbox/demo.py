"""The demo page (``/demo``): arm a fault in the simulated systems, clear them, start an
invoice, or play the demo runs again, from the browser. A supervisor's page of the console,
served by the sandbox app: the engine and the console know nothing of the simulated systems."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from recovery.engine import transitions
from recovery.http import permission_required, require_methods
from sandbox import demo_seed, faults
from sandbox.models import FAULTABLE, Fault, FaultMode

# What the reset started from this page printed: its one line, or its error.
RESET_LOG = settings.BASE_DIR / "var" / "seed_demo.log"


def demo_only(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """404 for everybody, whatever the method, unless the demo is on (``RECOVERY_DEMO``): read
    on every request, so that a deployment without it has no demo to find, signed in or not."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not settings.RECOVERY_DEMO:
            raise Http404("the demo is off (RECOVERY_DEMO)")
        return view(request, *args, **kwargs)

    return wrapper


@demo_only
@require_methods("GET", "HEAD", "POST")
@permission_required("sandbox")
def demo(request: HttpRequest) -> HttpResponse:
    message, status, started = "", 200, None
    if request.method == "POST":
        try:
            message, started = demo_action(request.POST, actor=request.user)
        except ValueError as exc:
            message, status = str(exc), 400
    context = {**demo_context(), "message": message, "error": status != 200, "started": started}
    return render(request, "sandbox/demo.html", context, status=status)


def demo_context() -> dict[str, Any]:
    return {
        "counts": faults.counts(),
        "armed": list(Fault.objects.using("sandbox").filter(remaining__gt=0).order_by("created_at")),
        "targets": [f"{service} {op}" for service, ops in FAULTABLE.items() for op in ops],
        "modes": FaultMode.values,
        "generation": demo_seed.current_generation(),
        "reset_playing": demo_seed.seed_playing(),
        "reset_log": _last_lines(RESET_LOG),
    }


def demo_action(data, *, actor: AbstractBaseUser) -> tuple[str, str | None]:
    """Arm a fault, clear the sandbox, or start a demo invoice: the sentence that says what was
    done, and the workflow id of the run started (the page links its run page). Raises
    ValueError."""
    if data.get("what") == "start":
        run, created = _start_invoice(data, actor=actor)
        return f"{'started' if created else 'already running'}: {run.workflow_id}", run.workflow_id
    return _demo_action(data, actor=actor), None


def _demo_action(data, *, actor: AbstractBaseUser) -> str:
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
    if what == "reset":
        if data.get("confirm") != "yes":
            raise ValueError("tick the box to reset: the unfinished demo runs are terminated and played again")
        return start_reset(actor)
    raise ValueError("unknown demo action")


def _start_invoice(data, *, actor: AbstractBaseUser):
    invoice_id = (data.get("invoice_id") or "").strip()
    text = (data.get("text") or "").strip()
    try:
        return transitions.run_start(
            workflow="invoice", data={"tenant": "demo", "invoice_id": invoice_id, "text": text}, actor=actor
        )
    except Exception as exc:  # pydantic validation, conflicts: shown on the page
        raise ValueError(f"could not start: {exc}") from exc


def start_reset(actor: AbstractBaseUser) -> str:
    """Start ``seed_demo --reset --as ACTOR`` in a process of its own (the seed drives the
    engine's clock, which is one per process; the executors running beside it leave the runs
    it plays alone). Raises ValueError while a seed is playing."""
    if demo_seed.seed_playing():
        raise ValueError("a seed is playing the demo right now; reload this page in a minute")
    RESET_LOG.parent.mkdir(parents=True, exist_ok=True)
    argv = ["seed_demo", "--reset", "--as", actor.get_username()]
    with RESET_LOG.open("a") as log:
        log.write(f"$ manage.py {' '.join(argv)}\n")
        log.flush()
        subprocess.Popen(
            [sys.executable, str(settings.BASE_DIR / "manage.py"), *argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # not stopped with this request, nor by a reload of the server
        )
    generation = demo_seed.generation_after_reset()
    ids = f" (ids ending in -r{generation})" if generation > 1 else ""
    return (
        f"reset started by {actor.get_username()}: the demo runs play again as new runs{ids} within a minute or "
        "two; the unfinished ones of the previous play are terminated and their open approval tasks done in the "
        "tracker, nothing is deleted"
    )


def _last_lines(path, count: int = 3) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-count:]
    except FileNotFoundError:
        return []


def _int(value: Any, default: int) -> int:
    try:
        return int(value) if value not in (None, "") else default
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a whole number") from None
