"""Demo runs for the console, made by the real engine against the real simulated systems.

Every state comes from the engine's own transitions: faults are armed in the sandbox (as the
``sandbox fault`` command does), a failpoint stops the executor where a crash would, the
model provider is swapped for one that answers off-schema, and the engine's clock is moved
forward instead of sleeping through retry intervals. No row is written by hand.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.management.base import CommandError
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler
from django.core.wsgi import get_wsgi_application
from django.utils import timezone

from recovery import clock as engine_clock
from recovery.engine import failpoints, transitions
from recovery.engine.executor import advance
from recovery.engine.publisher import publish
from recovery.errors import InvalidTransition
from recovery.management.base import RecoveryCommand
from recovery.management.commands.createoperator import ROLES, create_operator
from recovery.models import OutboxMessage, RunState, WorkflowRun
from recovery.workflow import get_workflow
from sandbox import faults
from sandbox.models import Fault

OWNER = "seed-demo"
# The demo model's scripted answers (MODEL_PROVIDER=scripted): the off-schema invoice, and the
# invoice whose approver the model gets wrong (the approval policy's guard stops it).
MODEL_SCRIPT = Path(__file__).resolve().parents[2] / "demo_model_script.json"
# The dropped answers cost one read timeout each; one second is plenty on one machine.
SEED_HTTP_TIMEOUT = 1.0
# Demo events arrive this far apart, over the past two hours; retries fit inside a slot.
SLOT = timedelta(minutes=10)
MAX_ROUNDS = 60
# How long the seed's runs stay its own if it dies mid-play (it releases them when it finishes).
RESERVATION = timedelta(minutes=15)
# Held while a seed plays, so that two seeds never play at once.
LOCK = settings.BASE_DIR / "var" / "seed_demo.lock"


# What each way of playing a scenario leaves the run in.
OUTCOMES = {
    "plain": RunState.COMPLETED,
    "task_answer_lost": RunState.COMPLETED,
    "ledger_unavailable_once": RunState.COMPLETED,
    "message_answer_lost": RunState.COMPLETED,
    "compensated": RunState.COMPENSATED,
    "unknown_outcome": RunState.NEEDS_REVIEW,
    "task_forbidden": RunState.FAILED,
    "model_off_schema": RunState.NEEDS_REVIEW,
    "model_wrong_approver": RunState.NEEDS_REVIEW,
    "compensation_fails": RunState.COMPENSATION_FAILED,
    "message_forbidden": RunState.NEEDS_REVIEW,
    "ledger_rate_limited": RunState.WAITING,
}
# Played on the real clock: its retry time must stay in the future.
LIVE = frozenset({"ledger_rate_limited"})


@dataclass(frozen=True)
class Scenario:
    tenant: str
    invoice_id: str
    vendor: str
    items: str
    total: str
    play: str  # the Seeder method that plays it

    def event(self, generation: int = 1) -> dict[str, Any]:
        text = f"{self.vendor} — {self.items}. Total due: {self.total}"
        return {
            "tenant": self.tenant,
            "invoice_id": invoice_id(self.invoice_id, generation),
            "vendor": self.vendor,
            "text": text,
        }


def invoice_id(base: str, generation: int) -> str:
    """The demo's invoice ids: as written for the first generation, ``-r2``, ``-r3`` … after each reset."""
    return base if generation == 1 else f"{base}-r{generation}"


# fmt: off
SCENARIOS = (
    Scenario("acme", "INV-1001", "ACME Office Supply", "40 ergonomic chairs and 10 desks", "EUR 1,840.00", "plain"),
    Scenario("globex", "GX-2024-117", "Globex Software", "annual licence, 25 seats", "USD 7,450.00",
             "task_answer_lost"),
    Scenario("initech", "IN-5531", "Initech Hardware", "12 laptops and 12 monitors", "EUR 18,960.00",
             "ledger_unavailable_once"),
    Scenario("umbrella", "UMB-0042", "Umbrella Travel", "flights and hotel, Berlin sales summit", "GBP 2,310.50",
             "message_answer_lost"),
    Scenario("hooli", "HL-889", "Hooli Cleaning", "monthly office cleaning, March", "EUR 980.00", "plain"),
    Scenario("stark", "SI-7781", "Stark Legal", "consulting on supplier contracts, 32 hours", "USD 12,400.00",
             "compensated"),
    Scenario("acme", "INV-1002", "ACME Office Supply", "6 standing desks and 2 chairs", "EUR 3,270.00",
             "unknown_outcome"),
    Scenario("globex", "GX-2024-118", "Globex Software", "SaaS subscription renewal, 12 months", "USD 2,400.00",
             "task_forbidden"),
    Scenario("initech", "IN-5532", "Initech", "taxi receipts for the client visit in Lyon", "EUR 146.80",
             "model_off_schema"),
    Scenario("umbrella", "UMB-0043", "Umbrella Hardware", "4 monitors for the support team", "GBP 1,196.00",
             "compensation_fails"),
    Scenario("soylent", "SC-104", "Soylent Catering", "lunch for the quarterly review, 45 people", "EUR 640.00",
             "message_forbidden"),
    Scenario("wayne", "WE-3302", "Wayne Paper Co", "200 reams of paper and 30 toner cartridges", "EUR 1,125.40",
             "ledger_rate_limited"),
    Scenario("globex", "GX-2024-119", "Globex Hardware", "8 laptops for the new analysts", "EUR 14,200.00",
             "model_wrong_approver"),
)
# fmt: on


@dataclass(frozen=True)
class Dispute:
    """A customer's dispute about one of the demo invoices, resolved by the dispute workflow's
    agent (played after the invoices, whose ledger entries it looks up)."""

    tenant: str
    dispute_id: str
    invoice_id: str  # a scenario's, above
    customer: str
    complaint: str
    play: str

    def event(self, generation: int = 1) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "dispute_id": invoice_id(self.dispute_id, generation),
            "invoice_id": invoice_id(self.invoice_id, generation),
            "customer": self.customer,
            "complaint": self.complaint,
        }


# fmt: off
DISPUTES = (
    Dispute("acme", "D-501", "INV-1001", "ap@acme.example",
            "Invoice INV-1001 overcharged us by 120.00 EUR: two chairs arrived damaged and went back.", "plain"),
    Dispute("initech", "D-502", "IN-5531", "finance@initech.example",
            "You charged us twice for invoice IN-5531.", "plain"),
    Dispute("hooli", "D-503", "HL-889", "office@hooli.example",
            "Invoice HL-889 overcharged us by 80.00 EUR: the windows were not cleaned.", "dispute_stopped"),
)
# fmt: on
DISPUTE_OUTCOMES = {"D-501": RunState.COMPLETED, "D-502": RunState.COMPLETED, "D-503": RunState.NEEDS_REVIEW}


class Command(RecoveryCommand):
    help = (
        "Seed a dozen demo invoice runs in every state (completed, waiting, needs_review, failed, compensated, "
        "compensation_failed) through the real engine and simulated systems, dated over the past two hours. "
        "Idempotent: demo runs that exist are left as they are, so running it again creates nothing. "
        "--reset plays them again as new runs (ids ending in -r2, -r3 …) after terminating the unfinished ones "
        "of the previous play; nothing is deleted. Running executors leave the demo runs alone while it plays."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--sandbox-url",
            help="where the simulated systems answer (default: SANDBOX_URL); if nothing answers there, "
            "a temporary server is started on a free local port for the seed's duration",
        )
        parser.add_argument(
            "--reset",
            action="store_true",
            help="play every scenario again as a new generation of runs; the previous generation's unfinished "
            "runs are terminated (audited, by --as), never deleted",
        )
        parser.add_argument(
            "--as",
            dest="username",
            metavar="USERNAME",
            help="the supervisor whose name the demo's operator actions carry (default: the first supervisor)",
        )

    def handle(self, *args, sandbox_url, reset, username, **options):
        try:
            seeded = seed_demo(sandbox_url=sandbox_url, warn=self.stderr.write, reset=reset, username=username)
        except LookupError as exc:
            raise CommandError(str(exc)) from None
        counts = ", ".join(f"{state} {seeded.states[state]}" for state in RunState.values if seeded.states[state])
        which = f", generation {seeded.generation} (ids end in -r{seeded.generation})" if seeded.generation > 1 else ""
        closed = f"; {seeded.terminated} unfinished run(s) of the previous generation terminated" if reset else ""
        self.stdout.write(
            f"seed_demo: {seeded.states.total()} demo runs, {len(SCENARIOS)} invoices and {len(DISPUTES)} disputes "
            f"({seeded.new} new){which}: {counts}{closed}"
        )


@dataclass(frozen=True)
class Seeded:
    generation: int
    states: Counter
    new: int
    terminated: int = 0


def generation_ids(generation: int) -> list[str]:
    workflow = get_workflow("invoice")
    return [workflow.workflow_id(workflow.validate_input(s.event(generation))) for s in SCENARIOS]


def dispute_ids(generation: int) -> list[str]:
    workflow = get_workflow("dispute")
    return [workflow.workflow_id(workflow.validate_input(d.event(generation))) for d in DISPUTES]


def current_generation() -> int:
    """The latest generation of demo runs that exists (1 when none does)."""
    generation = 1
    while WorkflowRun.objects.filter(workflow_id__in=generation_ids(generation + 1)).exists():
        generation += 1
    return generation


def generation_after_reset(current: int | None = None) -> int:
    """The generation a reset plays: the next one after ``current`` (default: the latest that
    exists), or the first if it was never played."""
    current = current_generation() if current is None else current
    return current + 1 if WorkflowRun.objects.filter(workflow_id__in=generation_ids(current)).exists() else current


def seed_demo(
    *,
    sandbox_url: str | None,
    warn: Callable[[str], object],
    reset: bool = False,
    username: str | None = None,
) -> Seeded:
    """Play every demo scenario whose run does not exist yet in the current generation; with
    ``reset``, first terminate the current generation's unfinished runs and play a new one.
    Returns the generation, its runs' states and how many were new. A scenario whose run
    exists is left as it is, so seeding again writes nothing (but the demo users' passwords
    under DEBUG). Refuses (CommandError, before writing) while foreign faults are armed in the
    sandbox, no supervisor exists, or another seed is playing."""
    with _one_seed_at_a_time():
        previous = current_generation()
        generation = generation_after_reset(previous) if reset else previous
        ids = generation_ids(generation)
        existing = set(
            WorkflowRun.objects.filter(workflow_id__in=ids + dispute_ids(generation)).values_list(
                "workflow_id", flat=True
            )
        )
        pending = [s for s, wid in zip(SCENARIOS, ids, strict=True) if wid not in existing]
        disputes = [d for d, wid in zip(DISPUTES, dispute_ids(generation), strict=True) if wid not in existing]
        if pending:
            _refuse_foreign_faults()
        if settings.DEBUG:
            for role in ROLES:
                create_operator(username=role, group=role, password=role)
        terminated = 0
        if pending or disputes:
            supervisor = _supervisor(username)
            if generation != previous:
                reason = f"demo reset by {supervisor.get_username()}: played again as generation {generation}"
                terminated = _close(generation_ids(previous) + dispute_ids(previous), supervisor, reason)
            url = (sandbox_url or settings.SANDBOX_URL).rstrip("/")
            timeout = min(settings.RECOVERY_HTTP_TIMEOUT, SEED_HTTP_TIMEOUT)
            with (
                sandbox_server(url) as served,
                # The seed is the executor of its runs: nothing is handed to Celery meanwhile.
                _settings(SANDBOX_URL=served, RECOVERY_HTTP_TIMEOUT=timeout, RECOVERY_EXECUTOR="embedded"),
                _environ(),
                _model_script(generation) as script,
            ):
                os.environ.pop("RECOVERY_FAILPOINTS", None)  # the seed arms its own, where it needs one
                seeder = Seeder(
                    supervisor=supervisor,
                    drop_ms=int((timeout + 0.5) * 1000),
                    warn=warn,
                    generation=generation,
                    script=script,
                )
                try:
                    seeder.play(pending)
                    seeder.play_disputes(disputes)
                finally:
                    seeder.disarm()
                    seeder.release()
        ids += dispute_ids(generation)
        states = Counter(WorkflowRun.objects.filter(workflow_id__in=ids).values_list("state", flat=True))
    return Seeded(generation=generation, states=states, new=len(pending) + len(disputes), terminated=terminated)


def _close(ids: list[str], supervisor: AbstractBaseUser, reason: str) -> int:
    """Terminate the unfinished runs among ``ids`` as ``supervisor`` (audited); effects stay made."""
    closed = 0
    for workflow_id in (
        WorkflowRun.objects.filter(workflow_id__in=ids)
        .exclude(state__in=transitions.TERMINAL_RUN_STATES)
        .order_by("pk")
        .values_list("workflow_id", flat=True)
    ):
        try:
            transitions.run_terminate(workflow_id=workflow_id, actor=supervisor, reason=reason)
        except InvalidTransition as exc:
            raise CommandError(f"seed_demo --reset: cannot terminate {workflow_id}: {exc}") from None
        closed += 1
    return closed


def seed_playing() -> bool:
    """Whether a seed holds the lock of ``_one_seed_at_a_time`` now."""
    try:
        with _one_seed_at_a_time():
            return False
    except CommandError:
        return True


@contextmanager
def _one_seed_at_a_time() -> Iterator[None]:
    """An exclusive lock on a file beside the embedded database: a second seed (a double click
    on the demo page's reset) is refused instead of playing the same scenarios twice."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CommandError(
                "another seed_demo is playing the demo right now; try again when it has finished"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def _model_script(generation: int) -> Iterator[Path]:
    """The demo model's script for this generation's invoice ids."""
    if generation == 1:
        yield MODEL_SCRIPT
        return
    answers = json.loads(MODEL_SCRIPT.read_text())
    with tempfile.TemporaryDirectory(prefix="seed-demo-") as folder:
        script = Path(folder) / "model_script.json"
        script.write_text(json.dumps({invoice_id(k, generation): v for k, v in answers.items()}))
        yield script


def _supervisor(username: str | None = None) -> AbstractBaseUser:
    """The supervisor whose name the demo's operator actions carry: ``username``, or the first one."""
    User = get_user_model()
    supervisors = User.objects.filter(groups__name="supervisor", is_active=True)
    if username:
        user = supervisors.filter(username=username).first()
        if user is None:
            raise CommandError(f"no active supervisor {username!r}")
        return user
    user = supervisors.order_by("pk").first()
    if user is None:
        raise CommandError(
            "seed_demo needs an active user in the 'supervisor' group for its operator actions: "
            "run `createoperator NAME --group supervisor` first (DJANGO_DEBUG creates the demo users itself)"
        )
    return user


def _refuse_foreign_faults() -> None:
    armed = list(Fault.objects.using(faults.DB).filter(remaining__gt=0))
    if armed:
        listed = "; ".join(str(f) for f in armed[:3]) + ("; …" if len(armed) > 3 else "")
        raise CommandError(
            f"the sandbox has {len(armed)} armed fault(s) that would change the demo ({listed}); "
            "let them be consumed or run `sandbox clear` first"
        )


class _Clock:
    """The engine's clock for the seed: starts in the past, jumps instead of sleeping, and
    ticks a little with each reading so that a run's events do not all share one instant."""

    TICK = timedelta(milliseconds=40)

    def __init__(self, start: datetime) -> None:
        self.current = start

    def now(self) -> datetime:
        self.current += self.TICK
        return self.current

    def set(self, when: datetime) -> None:
        self.current = max(self.current, when)

    def advance(self, seconds: float) -> None:
        self.current += timedelta(seconds=seconds)


class Seeder:
    """Plays scenarios: each starts its run, arms what its story needs, and drives the run the
    way the executor and the outbox publisher would, until it rests."""

    def __init__(
        self,
        *,
        supervisor: AbstractBaseUser,
        drop_ms: int,
        warn: Callable[[str], object],
        generation: int = 1,
        script: Path = MODEL_SCRIPT,
    ) -> None:
        self.supervisor = supervisor
        self.drop_ms = drop_ms
        self.warn = warn
        self.generation = generation
        self.script = script
        self.armed: list[int] = []
        self.played: list[int] = []
        past = sum(1 for s in SCENARIOS if s.play not in LIVE)
        self.start = timezone.now() - SLOT * (past + 1)
        self.clock = _Clock(self.start)

    def play(self, scenarios: list[Scenario]) -> None:
        for scenario in scenarios:
            if scenario.play in LIVE:
                run = self._play(scenario)
            else:
                self.clock.set(self.start + SLOT * SCENARIOS.index(scenario))
                with engine_clock.driven_by(self.clock.now):
                    run = self._play(scenario)
            if run.state != OUTCOMES[scenario.play]:
                expected = OUTCOMES[scenario.play]
                self.warn(f"seed_demo: {run.workflow_id} ended {run.state}, expected {expected}")

    def play_disputes(self, disputes: list[Dispute]) -> None:
        """After the invoices: each dispute in the slot after the last invoice's, on the past clock."""
        for number, dispute in enumerate(disputes, start=1):
            self.clock.set(self.start + SLOT * (len(SCENARIOS) - len(LIVE)) + SLOT * number / (len(DISPUTES) + 1))
            with engine_clock.driven_by(self.clock.now):
                reserve = (OWNER, timezone.now() + RESERVATION)
                run, _ = transitions.run_start(workflow="dispute", data=dispute.event(self.generation), reserve=reserve)
                self.played.append(run.pk)
                run = getattr(self, dispute.play)(run)
            if run.state != DISPUTE_OUTCOMES[dispute.dispute_id]:
                self.warn(
                    f"seed_demo: {run.workflow_id} ended {run.state}, expected {DISPUTE_OUTCOMES[dispute.dispute_id]}"
                )

    def _play(self, scenario: Scenario) -> WorkflowRun:
        # Reserved for the seed in real time: executors running beside it (make run's, Celery's)
        # leave the run alone until the seed has played its story and released it.
        reserve = (OWNER, timezone.now() + RESERVATION)
        run, _ = transitions.run_start(workflow="invoice", data=scenario.event(self.generation), reserve=reserve)
        self.played.append(run.pk)
        return getattr(self, scenario.play)(run)

    def release(self) -> None:
        """Give the played runs to every executor (the waiting one must be retried by them)."""
        transitions.runs_release_reservation(run_pks=self.played, owner=OWNER)

    def arm(self, service: str, operation: str, mode: str, **options: int) -> None:
        self.armed.append(faults.set_fault(service, operation, mode, **options).pk)

    def disarm(self) -> None:
        """Remove the seed's fault rows (all consumed when every scenario went as planned)."""
        Fault.objects.using(faults.DB).filter(pk__in=self.armed).delete()

    def drive(self, run: WorkflowRun, *, jump: bool = True) -> WorkflowRun:
        """Advance the run and deliver its outbox as production would; with ``jump``, move the
        clock to each retry time (or past a stopped executor's lease) until the run rests."""
        for _ in range(MAX_ROUNDS):
            advance(run.pk, owner=OWNER)
            for pk in OutboxMessage.objects.filter(run_id=run.pk).values_list("pk", flat=True):
                publish(pk, owner=OWNER)
            run.refresh_from_db()
            if run.lease_owner:  # an executor stopped holding it: its lease must expire first
                if not jump:
                    return run
                self.clock.advance(settings.RECOVERY_LEASE_SECONDS + 1)
            elif run.next_wake_at is not None and run.next_wake_at > engine_clock.now():
                if not jump:
                    return run
                self.clock.set(run.next_wake_at)
            elif run.next_wake_at is None and run.state not in (RunState.PENDING, RunState.COMPENSATING):
                return run
        raise CommandError(f"seed_demo: {run.workflow_id} did not come to rest ({run.state})")

    # --- the scenarios ------------------------------------------------------------------

    def plain(self, run: WorkflowRun) -> WorkflowRun:
        return self.drive(run)

    def task_answer_lost(self, run: WorkflowRun) -> WorkflowRun:
        """The tracker commits the task and the answer is lost: found by its key, one task."""
        self.arm("tasks", "create", "commit_then_drop", delay_ms=self.drop_ms)
        return self.drive(run)

    def ledger_unavailable_once(self, run: WorkflowRun) -> WorkflowRun:
        self.arm("ledger", "post", "unavailable")
        return self.drive(run)

    def message_answer_lost(self, run: WorkflowRun) -> WorkflowRun:
        """The messenger sends and the answer is lost: the outbox finds it, never resends."""
        self.arm("messages", "send", "commit_then_drop", delay_ms=self.drop_ms)
        return self.drive(run)

    def compensated(self, run: WorkflowRun) -> WorkflowRun:
        run = self.drive(run)
        self.clock.advance(300)
        transitions.run_compensate(
            workflow_id=run.workflow_id,
            actor=self.supervisor,
            reason="demo: duplicate of SI-7780, the vendor sent the invoice twice",
        )
        return self.drive(run)

    def unknown_outcome(self, run: WorkflowRun) -> WorkflowRun:
        """The tracker commits and the answer is lost; the executor stops right after recording
        the unknown outcome, and the tracker's look-up is unreachable for the whole look-up
        budget: the step stays unknown and an operator must reconcile it."""
        self.arm("tasks", "create", "commit_then_drop", delay_ms=self.drop_ms)
        with _environ(RECOVERY_FAILPOINTS="create_approval_task:after_outcome=raise"):
            try:
                advance(run.pk, owner=OWNER)
            except failpoints.FailpointRaised:
                pass
        with _settings(SANDBOX_URL=_unreachable_url()):
            return self.drive(run)

    def task_forbidden(self, run: WorkflowRun) -> WorkflowRun:
        self.arm("tasks", "create", "forbidden")
        return self.drive(run)

    def model_off_schema(self, run: WorkflowRun) -> WorkflowRun:
        # The model answers this invoice off schema (MODEL_PROVIDER=scripted, the demo's script).
        with _settings(MODEL_PROVIDER="scripted", MODEL_SCRIPT=str(self.script)):
            return self.drive(run)

    def model_wrong_approver(self, run: WorkflowRun) -> WorkflowRun:
        # The model names the IT lead for EUR 14,200 of laptops; the policy says the CFO. The
        # approval_policy guard stops the run before any task, message or entry exists.
        return self.model_off_schema(run)

    def compensation_fails(self, run: WorkflowRun) -> WorkflowRun:
        self.arm("ledger", "post", "forbidden")
        run = self.drive(run)
        self.clock.advance(240)
        self.arm("tasks", "cancel", "forbidden")
        transitions.run_compensate(
            workflow_id=run.workflow_id, actor=self.supervisor, reason="demo: vendor withdrew the invoice"
        )
        return self.drive(run)

    def message_forbidden(self, run: WorkflowRun) -> WorkflowRun:
        self.arm("messages", "send", "forbidden")
        return self.drive(run)

    def dispute_stopped(self, run: WorkflowRun) -> WorkflowRun:
        """The ledger is down when the agent issues its credit note; while the call waits for
        its retry, a supervisor stops the agent: nothing more is asked or sent until someone
        resumes it, forks it from a turn, or closes the dispute."""
        self.arm("ledger", "post", "unavailable")
        run = self.drive(run, jump=False)
        self.clock.advance(120)
        return transitions.agent_stop(
            workflow_id=run.workflow_id,
            step_name="resolve_dispute",
            actor=self.supervisor,
            reason="demo: the customer called; the credit is being checked with the cleaning contract",
        )

    def ledger_rate_limited(self, run: WorkflowRun) -> WorkflowRun:
        self.arm("ledger", "post", "rate_limit", retry_after=600)
        return self.drive(run, jump=False)


# --- the simulated systems' server ---------------------------------------------------------


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):
        pass


class _Server(ThreadedWSGIServer):
    daemon_threads = False  # server_close() waits for requests in flight (a dropped answer's delay)


@contextmanager
def sandbox_server(url: str) -> Iterator[str]:
    """Yield the URL of a server answering the sandbox endpoints: ``url`` if the sandbox
    answers there, else a temporary in-process server on a free local port, stopped on exit."""
    if _sandbox_answers(url):
        yield url
        return
    httpd = _Server(("127.0.0.1", 0), _QuietHandler)
    httpd.set_app(get_wsgi_application())
    thread = threading.Thread(target=httpd.serve_forever, name="seed-demo-sandbox", daemon=True)
    thread.start()
    # The faults' 4xx and 5xx answers are the point of the demo, not errors worth printing.
    request_log = logging.getLogger("django.request")
    level = request_log.level
    request_log.setLevel(logging.CRITICAL)
    try:
        served = f"http://127.0.0.1:{httpd.server_address[1]}"
        if not _sandbox_answers(served):
            raise CommandError(f"the temporary sandbox server at {served} does not answer (is 127.0.0.1 allowed?)")
        yield served
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)
        request_log.setLevel(level)


def _sandbox_answers(url: str) -> bool:
    """True if the sandbox answers at ``url``, False if nothing listens there; anything else
    listening there is an error."""
    try:
        response = httpx.get(
            f"{url}/sandbox/tasks/",
            params={"idempotency_key": "seed-demo-probe"},
            headers={"Authorization": f"Bearer {settings.SANDBOX_API_KEY}"},
            timeout=5,
        )
    except httpx.ConnectError:
        return False
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise CommandError(f"{url} does not answer like the sandbox: {type(exc).__name__}: {exc}") from None
    try:
        ok = response.status_code == 200 and "results" in response.json()
    except ValueError:
        ok = False
    if not ok:
        raise CommandError(f"{url} answers, but not as the sandbox (HTTP {response.status_code})")
    return True


def _unreachable_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextmanager
def _environ(**values: str) -> Iterator[None]:
    """The process environment with ``values`` set, as it was again afterwards."""
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def _settings(**values: Any) -> Iterator[None]:
    saved = {name: getattr(settings, name) for name in values}
    for name, value in values.items():
        setattr(settings, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(settings, name, value)
