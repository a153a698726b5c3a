"""Seed a throw-away PostgreSQL database with a production-sized engine history, fast.

Used by ``bench/console.py`` and ``bench/export.py``; it can also run alone:

    .venv/bin/python bench/seed.py --runs 1000000 --reuse bench_console_1m

writes 1,000,000 invoice runs, 5,000,000 steps (five per run), 10,000,000 audit events (``--audit``,
default ten per run), a simple-history version per run (two if a person acted on it), one model decision and one outbox
message per run that got that far, into the database named by ``--reuse`` (created and migrated
if missing, seeded only if not seeded yet, never dropped) on the server of ``--database-url``.

How it is fast: ``manage.py migrate --noinput`` creates the schema; the seed then records the
definitions of the big tables' indexes and key constraints (``pg_get_indexdef`` /
``pg_get_constraintdef``), drops them, loads every table with one ``COPY … FROM STDIN (FREEZE)``
(psycopg's ``cursor.copy()``, rows formatted as COPY text in Python) after a ``TRUNCATE`` in the
same transaction, recreates the indexes and constraints exactly as the migrations made them,
moves the identity sequences past the loaded ids, and runs ``VACUUM (ANALYZE)``. Roughly 16M
rows take about five minutes on two cores (280 s measured).

The data (deterministic for a given ``--seed``): runs spread over ``--days`` days (newest last,
ids in creation order), mostly completed; about 1% failed, compensated or terminated; the newest
0.3% still live (pending, running with a valid lease, waiting for a retry); and 0.4% stuck
(at least 12), covering every cause of ``recovery.counts.stuck_causes``: needs review
(a refused message), unknown outcome (in review, and waiting for a deferred reconciliation),
lease expired, retries exhausted, compensation failed, and model output invalid. Workflow ids
look like ``invoice:<tenant>:<invoice number>``, idempotency keys are the engine's own
``sha256(workflow_id:step:v1)``, remote references are the simulated systems' (``task_N``,
``msg_N``, ``le_N``). One run, ``invoice:acme-logistics:INV-RETRY-STORM``, has exactly 1,000
audit events (a reconciliation that kept failing for two days). No text holds a newline, a tab
or a backslash, so CSV and JSON Lines exports have one line per event.

What the benchmarks need to find again (search targets, the detail run, the seed's time) is
stored in the database itself, in the table ``bench_seed_info``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

if __package__ in (None, ""):  # run as a script: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recovery.engine.audit import chain as audit_chain  # noqa: E402
from recovery.fields import canonical_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MANAGE = str(ROOT / "manage.py")
DEFAULT_ADMIN_URL = "postgres://postgres@127.0.0.1:5432/postgres"

STEPS = ("read_invoice", "classify", "create_approval_task", "notify_approver", "post_ledger_entry")
BIG_TABLES = (
    "recovery_workflowrun",
    "recovery_stepexecution",
    "recovery_auditevent",
    "recovery_historicalworkflowrun",
    "recovery_modeldecision",
    "recovery_outboxmessage",
)
DETAIL_WORKFLOW_ID = "invoice:acme-logistics:INV-RETRY-STORM"
DETAIL_EVENTS = 1000
HUMAN_USERNAME = "ops-alice"
NULL = "\\N"

TENANT_BASES = (
    "acme", "globex", "initech", "umbrella", "stark", "wayne", "hooli", "soylent", "contoso", "tyrell",
    "cyberdyne", "wonka", "gringotts", "oceanic", "vandelay", "dunder", "pied-piper", "massive", "nakatomi", "aperture",
)  # fmt: skip
TENANT_SUFFIXES = ("logistics", "retail", "health", "labs", "energy", "foods", "media", "bank", "travel", "legal")
VENDORS = (
    "Acme Office Supply", "Globex Software", "Initech Hardware", "Umbrella Travel", "Hooli Cleaning",
    "Stark Legal", "Wayne Paper Co", "Soylent Catering", "Contoso Facilities", "Tyrell Cloud",
)  # fmt: skip
ITEMS = (
    ("40 ergonomic chairs and 10 desks", "office_supplies"),
    ("annual licence, 25 seats", "software"),
    ("12 laptops and 12 monitors", "hardware"),
    ("flights and hotel, Berlin sales summit", "travel"),
    ("monthly office cleaning, March", "facilities"),
    ("consulting on supplier contracts, 32 hours", "professional_services"),
    ("200 reams of paper and 30 toner cartridges", "office_supplies"),
    ("lunch for the quarterly review, 45 people", "catering"),
    ("cloud hosting, 12 months", "software"),
    ("taxi receipts for the client visit in Lyon", "travel"),
)
CURRENCIES = ("EUR", "EUR", "EUR", "USD", "USD", "GBP", "CHF")
APPROVERS = ("finance@example.com", "ap-team@example.com", "cfo@example.com", "controller@example.com")


# --- database lifecycle --------------------------------------------------------------------


def database_url(server_url: str, name: str) -> str:
    """``server_url`` with its database replaced by ``name``."""
    parts = urlsplit(server_url)
    return urlunsplit(parts._replace(path=f"/{name}"))


def database_exists(admin_url: str, name: str) -> bool:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None


def create_database(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop_database(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        drop_database_on(conn, name)


def drop_database_on(conn: psycopg.Connection, name: str) -> None:
    """Drop ``name`` through an autocommit connection, its clients disconnected (FORCE)."""
    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@contextmanager
def bench_run(args: argparse.Namespace, *, prefix: str) -> Iterator[tuple[BenchDatabase, Path]]:
    """A benchmark's database (``open_from_args``) and scratch directory: the database is closed
    at the end, the directory removed unless ``--keep`` (then its path is logged)."""
    db = open_from_args(args, prefix=prefix)
    work = Path(tempfile.mkdtemp(prefix=f"{prefix.replace('_', '-')}-"))
    try:
        yield db, work
    finally:
        db.close()
        if args.keep:
            log(f"kept the server's logs in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def print_summary(summary: dict[str, Any], load_before: tuple[float, float, float]) -> None:
    """The benchmark's last line: its figures as one JSON object, with the load average before
    and after (another CPU-heavy process on a small machine makes every figure noisy)."""
    loads = {
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps({**summary, **loads}))


def django_env(db_url: str, **extra: str) -> dict[str, str]:
    """The environment of a Django child process on ``db_url``: production settings, an
    in-memory SQLite database for the (unused) sandbox alias, so nothing under var/ is touched."""
    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "SANDBOX_DATABASE_URL": "sqlite://:memory:",
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "DJANGO_DEBUG": "0",
        "DJANGO_SECRET_KEY": os.environ.get("DJANGO_SECRET_KEY", "bench-" + hashlib.sha256(os.urandom(16)).hexdigest()),
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1",
        "DJANGO_SECURE_SSL_REDIRECT": "0",  # plain HTTP on the loopback: no TLS to redirect to
        "RECOVERY_LOG_LEVEL": "WARNING",
    }
    env.update(extra)
    return env


def manage(db_url: str, *args: str, **env: str) -> str:
    """Run ``manage.py args…`` on ``db_url``; its stdout, or SystemExit with its stderr."""
    done = subprocess.run(
        [sys.executable, MANAGE, *args], cwd=ROOT, env=django_env(db_url, **env), capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"manage.py {' '.join(args)} failed:\n{done.stderr}")
    return done.stdout


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- the plan: what each run is ------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    runs: int
    audit: int  # total audit events; ten per run by default

    @property
    def steps(self) -> int:
        return len(STEPS) * self.runs


@dataclass
class Run:
    id: int
    kind: str  # completed, failed, compensated, terminated, pending, running, waiting, or a stuck cause
    state: str
    pos: int  # the step the run is at / stopped on
    tenant: str
    invoice: str
    vendor: str
    item: str
    category: str
    amount: str
    currency: str
    approver: str
    created: float
    updated: float
    events: int
    human: bool = False

    @property
    def workflow_id(self) -> str:
        return f"invoice:{self.tenant}:{self.invoice}"


# kind -> (run state, position of the step it stopped on); live kinds are only given to new runs
KINDS: dict[str, tuple[str, int]] = {
    "completed": ("completed", 4),
    "failed": ("failed", 2),
    "compensated": ("compensated", 4),
    "terminated": ("terminated", 4),
    "pending": ("pending", 0),
    "running": ("running", 3),
    "waiting": ("waiting", 4),
    # stuck, one kind per cause (counts.stuck_causes); "unknown" twice: in review and waiting
    "review": ("needs_review", 3),
    "unknown_review": ("needs_review", 2),
    "unknown_waiting": ("waiting", 4),
    "lease_expired": ("running", 2),
    "exhausted": ("needs_review", 4),
    "compensation_failed": ("compensation_failed", 2),
    "model_output": ("needs_review", 1),
    "retry_storm": ("needs_review", 2),  # the detail run
}
OLD_MIX = (("completed", 0.976), ("failed", 0.012), ("compensated", 0.008), ("terminated", 0.004))
LIVE_MIX = (("completed", 0.5), ("waiting", 0.25), ("running", 0.15), ("pending", 0.10))
STUCK_MIX = (
    ("review", 0.2),
    ("unknown_review", 0.1),
    ("unknown_waiting", 0.1),
    ("lease_expired", 0.1),
    ("exhausted", 0.2),
    ("compensation_failed", 0.1),
    ("model_output", 0.2),
)
STUCK_FRACTION = 0.004
LIVE_FRACTION = 0.003


def _pick(rng: random.Random, mix: tuple[tuple[str, float], ...]) -> str:
    x = rng.random()
    for kind, weight in mix:
        x -= weight
        if x < 0:
            return kind
    return mix[0][0]


@dataclass
class Plan:
    size: Size
    now: float
    days: float
    seed: int
    runs: list[Run] = field(default_factory=list)
    detail_id: int = 0
    search_id: int = 0
    normal_detail_id: int = 0

    @classmethod
    def build(cls, size: Size, *, days: float, seed: int, now: float) -> Plan:
        if size.runs < 100:
            raise SystemExit("--runs must be at least 100")
        if size.audit < size.runs + DETAIL_EVENTS:
            raise SystemExit("--audit must be at least runs + 1000")
        plan = cls(size=size, now=now, days=days, seed=seed)
        rng = random.Random(seed)
        n = size.runs
        kinds = plan._kinds(rng)
        per_run, extra = divmod(size.audit - DETAIL_EVENTS, n - 1)
        span = days * 86400.0
        start = now - span
        tenants = [f"{b}-{s}" for b in TENANT_BASES for s in TENANT_SUFFIXES]
        extra_left = extra
        for i in range(1, n + 1):
            kind = kinds[i]
            created = start + span * (i - 1) / n + rng.random() * span / n * 0.5
            duration = plan._duration(kind, rng, created)
            item, category = ITEMS[rng.randrange(len(ITEMS))]
            tenant = tenants[rng.randrange(len(tenants))]
            if i == plan.detail_id:
                events, tenant, invoice = DETAIL_EVENTS, "acme-logistics", "INV-RETRY-STORM"
            else:
                events = per_run + (1 if extra_left > 0 else 0)
                extra_left -= 1
                invoice = f"INV-{2024 + (i * 3) // n}-{i:07d}"
            plan.runs.append(
                Run(
                    id=i,
                    kind=kind,
                    state=KINDS[kind][0],
                    pos=KINDS[kind][1] if kind != "running" else rng.randrange(5),
                    tenant=tenant,
                    invoice=invoice,
                    vendor=VENDORS[rng.randrange(len(VENDORS))],
                    item=item,
                    category=category,
                    amount=f"{rng.randrange(50, 25000)}.{rng.randrange(100):02d}",
                    currency=CURRENCIES[rng.randrange(len(CURRENCIES))],
                    approver=APPROVERS[rng.randrange(len(APPROVERS))],
                    created=created,
                    updated=min(created + duration, now - 1.0),
                    events=events,
                    human=kind in ("compensated", "terminated", "compensation_failed") or rng.random() < 0.003,
                )
            )
        return plan

    def _kinds(self, rng: random.Random) -> list[str]:
        n = self.size.runs
        kinds = [""] * (n + 1)
        live_from = n - max(30, int(n * LIVE_FRACTION))
        for i in range(1, n + 1):
            kinds[i] = _pick(rng, LIVE_MIX if i > live_from else OLD_MIX)
        self.detail_id = n - n // 100  # three days or so before the end
        self.search_id = max(2, n // 20)  # an old run: the worst case for a newest-first scan
        self.normal_detail_id = self.search_id + 1
        reserved = {self.detail_id, self.search_id, self.normal_detail_id}
        n_stuck = max(12, int(n * STUCK_FRACTION))
        recent = range(max(1, n - n // 50), live_from)
        candidates = [i for i in range(1, live_from) if i not in reserved]
        for cause, weight in STUCK_MIX:
            count = max(2, round(n_stuck * weight))
            pool = [i for i in recent if i not in reserved] if cause == "lease_expired" else candidates
            for i in rng.sample(pool, min(count, len(pool))):
                kinds[i] = cause
                reserved.add(i)
        kinds[self.detail_id] = "retry_storm"
        kinds[self.search_id] = kinds[self.normal_detail_id] = "completed"
        return kinds

    def _duration(self, kind: str, rng: random.Random, created: float) -> float:
        if kind == "retry_storm":
            return 2 * 86400.0
        if kind == "completed":
            return 2.0 + rng.random() * 8.0 if rng.random() < 0.9 else 60.0 + rng.random() * 3600.0
        if kind in ("pending", "running", "lease_expired"):
            return rng.random() * 5.0
        return 30.0 + rng.random() * 6 * 3600.0

    def info(self) -> dict:
        target = self.runs[self.search_id - 1]
        return {
            "runs": self.size.runs,
            "steps": self.size.steps,
            "audit": self.size.audit,
            "days": self.days,
            "seed": self.seed,
            "seeded_at": datetime.fromtimestamp(self.now, UTC).isoformat(),
            "detail_workflow_id": DETAIL_WORKFLOW_ID,
            "normal_workflow_id": self.runs[self.normal_detail_id - 1].workflow_id,
            "search_workflow_id": target.workflow_id,
            "search_idempotency_key": idempotency_key(target.workflow_id, "create_approval_task"),
            "search_remote_ref": f"le_{target.id}",
            "search_business_key": f"invoice:{target.tenant}",
            "kinds": _count(r.kind for r in self.runs),
        }


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def idempotency_key(workflow_id: str, step: str, key_version: int = 1) -> str:
    """The engine's key (recovery.workflow.idempotency_key)."""
    return hashlib.sha256(f"{workflow_id}:{step}:v{key_version}".encode()).hexdigest()


def ts(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(" ")


def opt_ts(epoch: float | None) -> str:
    return NULL if epoch is None else ts(epoch)


# --- rows ----------------------------------------------------------------------------------


def run_input(r: Run) -> str:
    text = f"{r.vendor} \u2014 {r.item}. Total due: {r.currency} {r.amount}"
    return json.dumps(
        {"tenant": r.tenant, "invoice_id": r.invoice, "text": text, "vendor": r.vendor}, ensure_ascii=False
    )


def status_of(r: Run) -> tuple[str, str]:
    """(current_step, status_reason)."""
    step = STEPS[r.pos]
    return {
        "completed": ("", ""),
        "failed": (step, f"{step}: permanent error, not retried: create approval task: HTTP 403 forbidden"),
        "compensated": ("", "every completed effect was compensated"),
        "terminated": (step, "terminated by ops-alice: duplicate invoice, paid by hand"),
        "pending": ("", ""),
        "running": (step, ""),
        "waiting": (step, f"{step}: not due yet"),
        "review": (step, f"{step}: message not delivered after 1 attempt(s): notify approver: HTTP 403 forbidden"),
        "unknown_review": (step, f"{step}: outcome unknown and look-up failed"),
        "unknown_waiting": (step, f"{step}: outcome unknown; look-up deferred: ledger unavailable"),
        "lease_expired": (step, ""),
        "exhausted": (step, f"{step}: retries exhausted after 6 attempts: post ledger entry: HTTP 503 unavailable"),
        "compensation_failed": (step, f"{step}: compensation failed: cancel task: HTTP 403 forbidden"),
        "model_output": (step, "model output invalid 3 times"),
        "retry_storm": (step, f"{step}: outcome unknown and look-up failed after 498 attempts"),
    }[r.kind]


def run_rows(plan: Plan) -> Iterator[str]:
    now = plan.now
    for r in plan.runs:
        current, reason = status_of(r)
        inp = run_input(r)
        lease_owner, lease_expires, wake = "", None, None
        if r.kind == "running":
            lease_owner, lease_expires = "worker-1@bench:4242", now + 25.0
        elif r.kind == "lease_expired":
            lease_owner, lease_expires = "worker-2@bench:1717", r.updated + 30.0
        elif r.state == "waiting":
            wake = now + 60.0 + (r.id % 600)
        yield (
            "\t".join(
                (
                    str(r.id),
                    r.workflow_id,
                    "invoice",
                    "1",
                    r.state,
                    current,
                    inp,
                    hashlib.sha256(inp.encode()).hexdigest(),
                    reason,
                    lease_owner,
                    opt_ts(lease_expires),
                    str(2 if r.state != "pending" else 0),
                    opt_ts(wake),
                    ts(r.created),
                    ts(r.updated),
                    "",
                    NULL,
                )
            )
            + "\n"
        )


RUN_COLUMNS = (
    "id, workflow_id, workflow_name, workflow_version, state, current_step, input, input_hash, status_reason, "
    "lease_owner, lease_expires_at, lease_generation, next_wake_at, created_at, updated_at, incident, dispatched_at"
)


def history_rows(plan: Plan, user_id: int) -> Iterator[str]:
    """The versions simple-history keeps: the start of every run, and the last change of the runs a
    person acted on; the detail run has DETAIL_EVENTS // 4 (more than the run page shows)."""
    history_id = 0
    for r in plan.runs:
        current, reason = status_of(r)
        inp = run_input(r)
        digest = hashlib.sha256(inp.encode()).hexdigest()
        if r.kind == "retry_storm":
            n = DETAIL_EVENTS // 4
            versions = [
                ("~" if k else "+", "running" if k % 2 else "waiting", r.created + (r.updated - r.created) * k / n)
                for k in range(n)
            ]
        elif r.human:
            versions = [("+", "pending", r.created), ("~", r.state, r.updated)]
        else:
            versions = [("+", "pending", r.created)]
        for kind, state, at in versions:
            history_id += 1
            yield (
                "\t".join(
                    (
                        str(r.id),
                        r.workflow_id,
                        "invoice",
                        "1",
                        state,
                        current if kind == "~" else "",
                        inp,
                        digest,
                        reason if kind == "~" else "",
                        "",
                        "2" if kind == "~" else "0",
                        NULL,
                        ts(r.created),
                        ts(at),
                        str(history_id),
                        ts(at),
                        NULL,
                        kind,
                        str(user_id) if r.human and kind == "~" else NULL,
                        "",
                    )
                )
                + "\n"
            )


HISTORY_COLUMNS = (
    "id, workflow_id, workflow_name, workflow_version, state, current_step, input, input_hash, status_reason, "
    "lease_owner, lease_generation, next_wake_at, created_at, updated_at, history_id, history_date, "
    "history_change_reason, history_type, history_user_id, incident"
)


def step_outcome(r: Run, k: int) -> tuple[str, str, str, int]:
    """(state, last_error_kind, last_error, attempts) of step ``k`` of run ``r``."""
    if r.kind in ("completed", "review") or k < r.pos:
        return "succeeded", "", "", 1
    if k > r.pos:
        if r.kind == "terminated":
            return "skipped", "", "", 0
        if r.kind in ("compensated", "compensation_failed"):
            return "compensated", "", "", 1
        return "pending", "", "", 0
    return {
        "failed": ("failed", "permanent", "create approval task: HTTP 403 forbidden (simulated)", 1),
        "compensated": ("compensated", "", "", 1),
        "terminated": ("failed", "transient", "post ledger entry: HTTP 503 unavailable (simulated)", 2),
        "pending": ("pending", "", "", 0),
        "running": ("running", "", "", 1),
        "waiting": ("failed", "rate_limited", "post ledger entry: HTTP 429 rate limited (simulated)", 1),
        "unknown_review": ("unknown", "unknown_outcome", "reconcile failed: look up task by key: ConnectError", 1),
        "unknown_waiting": ("unknown", "unknown_outcome", "post ledger entry: no response (ReadTimeout)", 1),
        "lease_expired": ("running", "", "", 1),
        "exhausted": ("failed", "transient", "post ledger entry: HTTP 503 unavailable (simulated)", 6),
        "compensation_failed": (
            "compensation_failed",
            "permanent",
            "compensation: cancel task: HTTP 403 forbidden (simulated)",
            1,
        ),
        "model_output": ("failed", "invalid_model_output", "model output does not match InvoiceDecision", 3),
        "retry_storm": ("unknown", "unknown_outcome", "reconcile failed: look up task by key: ConnectError", 1),
    }[r.kind]


def remote_ref(r: Run, k: int) -> str:
    return ("", "", f"task_{r.id}", f"msg_{r.id}", f"le_{r.id}")[k]


def step_rows(plan: Plan) -> Iterator[str]:
    step_id = 0
    for r in plan.runs:
        text = f"{r.vendor} \u2014 {r.item}. Total due: {r.currency} {r.amount}"
        decision = (
            f'{{"category": "{r.category}", "amount": "{r.amount}", "currency": "{r.currency}", '
            f'"approver": "{r.approver}", "confidence": 0.95, "rationale": "Matched keyword ({r.category})."}}'
        )
        intents = (
            "{}",
            f'{{"invoice_id": "{r.invoice}", "text": "{text}"}}',
            f'{{"title": "Approve invoice {r.invoice}: {r.amount} {r.currency}", "assignee": "{r.approver}", '
            f'"payload": {{"tenant": "{r.tenant}", "invoice_id": "{r.invoice}", "amount": "{r.amount}"}}}}',
            f'{{"to": "{r.approver}", "text": "Invoice {r.invoice} ({r.amount} {r.currency}) awaits your approval"}}',
            f'{{"reference": "{r.workflow_id}", "amount": "{r.amount}", "currency": "{r.currency}", '
            f'"account": "expenses:{r.category}", "memo": "invoice {r.invoice} ({r.tenant})"}}',
        )
        results = (
            f'{{"text": "{text}", "characters": {len(text)}}}',
            decision,
            f'{{"task_id": "task_{r.id}", "status": "open"}}',
            f'{{"message_id": "msg_{r.id}", "to": "{r.approver}", "delivered": true}}',
            f'{{"entry_id": "le_{r.id}", "reference": "{r.workflow_id}", "amount": "{r.amount}"}}',
        )
        for k, name in enumerate(STEPS):
            step_id += 1
            state, error_kind, error, attempts = step_outcome(r, k)
            started = state != "pending" and state != "skipped"
            done = state in ("succeeded", "compensated", "compensation_failed")
            at = r.created + (r.updated - r.created) * (k + 1) / 6
            key = idempotency_key(r.workflow_id, name)
            ref = remote_ref(r, k) if done else ""
            compensated = state in ("compensated", "compensation_failed") and k >= 2
            yield (
                "\t".join(
                    (
                        str(step_id),
                        name,
                        str(k),
                        state,
                        "1",
                        key,
                        intents[k] if started else NULL,
                        hashlib.sha256(key.encode()).hexdigest() if started else "",
                        ref,
                        results[k] if done else NULL,
                        str(attempts),
                        "0",
                        ts(at) if started else NULL,
                        str(attempts - 1 if error_kind == "invalid_model_output" else 0),
                        str(1 if error_kind == "unknown_outcome" else 0),
                        ts(at) if started else NULL,
                        ts(at) if started else NULL,
                        error_kind,
                        error,
                        ts(plan.now + 120.0) if r.kind == "waiting" and k == r.pos else NULL,
                        ts(at if started else r.created),
                        str(r.id),
                        "1" if compensated else "0",
                        f"{ref}-undo" if compensated and state == "compensated" else "",
                        '{"cancelled": true}' if compensated and state == "compensated" else NULL,
                        "t" if compensated and state == "compensated" else "f",
                    )
                )
                + "\n"
            )


STEP_COLUMNS = (
    "id, step_name, position, state, key_version, idempotency_key, intent, request_hash, remote_ref, result, "
    "attempts, budget_start_attempt, budget_started_at, format_failures, reconcile_attempts, first_attempt_at, "
    "last_attempt_at, last_error_kind, last_error, next_attempt_at, updated_at, run_id, compensation_attempts, "
    "compensation_ref, compensation_result, compensation_restored"
)


# An audit event template: (step, action, reason, before, after, actor is a human). "#N#" is the run id.
Event = tuple[str, str, str, str, str, bool]


def _snap(run: str, step: str | None = None, attempts: int = 0, ref: str = "", kind: str = "") -> str:
    parts = [f'"run": "{run}"']
    if step is not None:
        parts += [f'"step": "{step}"', f'"attempts": {attempts}']
        if ref:
            parts.append(f'"remote_ref": "{ref}"')
        if kind:
            parts.append(f'"error_kind": "{kind}"')
    return "{" + ", ".join(parts) + "}"


def _step_events(k: int) -> list[Event]:
    name = STEPS[k]
    ref = ("", "", "task_#N#", "outbox:#N#", "le_#N#")[k]
    begin = _snap("running", "pending", 0)
    if name == "notify_approver":
        return [(name, "step_enqueue", "", begin, _snap("running", "succeeded", 1, ref), False)]
    return [
        (name, "step_begin", "", begin, _snap("running", "running", 1), False),
        (name, "step_succeed", "", _snap("running", "running", 1), _snap("running", "succeeded", 1, ref), False),
    ]


START: list[Event] = [
    ("", "start", "", "{}", _snap("pending"), False),
    ("", "claim", "", _snap("pending"), '{"run": "running", "lease_owner": "worker-1@bench:4242"}', False),
]
RETRY_CYCLE: list[Event] = [
    ("", "claim", "", _snap("waiting"), '{"run": "running", "lease_owner": "worker-2@bench:1717"}', False),
    ("", "wait", "not due yet", _snap("running"), _snap("waiting"), False),
]
# The detail run's two days of failed look-ups of an unknown outcome.
STORM_CYCLE: list[Event] = [
    ("", "claim", "", _snap("waiting"), '{"run": "running", "lease_owner": "worker-2@bench:1717"}', False),
    (
        "create_approval_task",
        "reconcile_deferred",
        "look up task by key: could not connect (ConnectError); the request was not sent",
        _snap("running", "unknown", 1, "", "unknown_outcome"),
        _snap("waiting", "unknown", 1, "", "unknown_outcome"),
        False,
    ),
]


def _ending(kind: str, pos: int) -> list[Event]:
    step = STEPS[pos]
    fail = _snap("running", "running", 1)
    return {
        "completed": [("", "complete", "", _snap("running"), _snap("completed"), False)],
        "failed": [(step, "step_fail", "HTTP 403", fail, _snap("failed", "failed", 1, "", "permanent"), False)],
        "compensated": [
            ("", "compensate", "vendor withdrew the invoice", _snap("completed"), _snap("compensating"), True),
            ("", "compensation_done", "every effect compensated", _snap("compensating"), _snap("compensated"), False),
        ],
        "terminated": [("", "terminate", "duplicate invoice", _snap("waiting"), _snap("terminated"), True)],
        "pending": [],
        "running": [],
        "waiting": [(step, "step_fail", "HTTP 429", fail, _snap("waiting", "failed", 1, "", "rate_limited"), False)],
        "review": [("notify_approver", "review", "message refused", _snap("running"), _snap("needs_review"), False)],
        "unknown_review": [
            (step, "step_unknown", "no response (ReadTimeout)", fail, _snap("running", "unknown", 1), False),
            (step, "reconcile_deferred", "look-up failed", fail, _snap("needs_review", "unknown", 1), False),
        ],
        "unknown_waiting": [
            (step, "step_unknown", "no response (ReadTimeout)", fail, _snap("running", "unknown", 1), False),
            (step, "reconcile_deferred", "ledger unavailable", fail, _snap("waiting", "unknown", 1), False),
        ],
        "lease_expired": [(step, "step_begin", "", _snap("running", "pending"), fail, False)],
        "exhausted": [
            (step, "step_fail", "HTTP 503", fail, _snap("needs_review", "failed", 6, "", "transient"), False)
        ],
        "compensation_failed": [
            ("", "compensate", "vendor withdrew the invoice", _snap("failed"), _snap("compensating"), True),
            (step, "compensation_fail", "cancel task: HTTP 403", fail, _snap("compensation_failed"), False),
        ],
        "model_output": [
            (
                step,
                "step_fail",
                "model output invalid",
                fail,
                _snap("needs_review", "failed", 3, "", "invalid_model_output"),
                False,
            )  # noqa: E501
        ],
        "retry_storm": [
            (step, "step_unknown", "no response (ReadTimeout)", fail, _snap("running", "unknown", 1), False),
            (step, "reconcile_deferred", "look-up failed", fail, _snap("needs_review", "unknown", 1), False),
        ],
    }[kind]


_SCRIPTS: dict[tuple[str, int, int], list[Event]] = {}


def script(r: Run) -> list[Event]:
    """Exactly ``r.events`` audit events: the run's story (start, claim, its steps, its ending),
    shortened in the middle or lengthened with retry cycles to fit."""
    cache_key = (r.kind, r.pos, r.events)
    if cache_key in _SCRIPTS:
        return _SCRIPTS[cache_key]
    reached = 5 if r.kind in ("completed", "compensated", "review") else r.pos
    story = [e for k in range(reached) for e in _step_events(k)]
    ending = _ending(r.kind, r.pos)
    head = START[: r.events]
    room = r.events - len(head) - len(ending)
    if room < 0:
        events = (head + ending)[-r.events :]
    elif len(story) >= room:
        events = head + story[:room] + ending
    else:
        cycle = STORM_CYCLE if r.kind == "retry_storm" else RETRY_CYCLE
        cycles = (cycle * (room - len(story)))[: room - len(story)]
        events = head + story + cycles + ending
    # As the engine stores them: canonical text (recovery.fields; the export hands it out as is).
    events = [
        (step, action, reason, canonical_json(json.loads(before)), canonical_json(json.loads(after)), human)
        for step, action, reason, before, after, human in events
    ]
    _SCRIPTS[cache_key] = events
    return events


def audit_rows(plan: Plan, user_id: int) -> Iterator[str]:
    event_id = 0
    user = str(user_id)
    for r in plan.runs:
        events = script(r)
        n = len(events)
        span = r.updated - r.created
        rid = str(r.id)
        workflow_id = r.workflow_id
        prev = ""
        for j, (step, action, reason, before, after, human) in enumerate(events):
            event_id += 1
            if "#N#" in after:
                after = after.replace("#N#", rid)
            is_human = human and r.human
            actor = HUMAN_USERNAME if is_human else "executor"
            at = datetime.fromtimestamp(r.created + span * j / n, UTC)
            # The chain the database's trigger would have computed (disabled for the COPY: with the
            # indexes dropped, its look-up of the run's previous event would read the whole table).
            digest = audit_chain.event_hash(
                prev, (audit_chain.at_text(at), workflow_id, "invoice", step, actor, action, reason, before, after)
            )
            yield (
                f"{event_id}\t{step}\t{actor}\t{action}\t{reason}\t{before}\t"
                f"{after}\t{at.isoformat(' ')}\t{user if is_human else NULL}\t{rid}\t{prev}\t{digest}\n"
            )
            prev = digest


AUDIT_COLUMNS = "id, step_name, actor, action, reason, before, after, at, actor_user_id, run_id, prev_hash, hash"


def decision_rows(plan: Plan) -> Iterator[str]:
    decision_id = 0
    for r in plan.runs:
        if r.kind == "model_output":
            for _ in range(3):
                decision_id += 1
                yield (
                    f"{decision_id}\tclassify\t0\tinvalid\t1\t{NULL}\t{NULL}\t{{category: ???}}\t"
                    f"3 validation errors for InvoiceDecision\t\t{ts(r.created + 1.0)}\t{r.id}\n"
                )
        elif r.pos >= 2 or r.kind in ("completed", "review"):
            decision_id += 1
            accepted = (
                f'{{"category": "{r.category}", "amount": "{r.amount}", "currency": "{r.currency}", '
                f'"approver": "{r.approver}", "confidence": 0.95}}'
            )
            at = ts(r.created + 1.0)
            yield f"{decision_id}\tclassify\t1\taccepted\t1\t{accepted}\t{accepted}\t\t\t\t{at}\t{r.id}\n"


DECISION_COLUMNS = (
    "id, step_name, version, state, schema_version, proposal, accepted, invalid_output, validation_error, "
    "superseded_reason, created_at, run_id"
)


def outbox_rows(plan: Plan) -> Iterator[str]:
    outbox_id = 0
    for r in plan.runs:
        if not (r.pos >= 4 or r.kind in ("completed", "review")):
            continue
        outbox_id += 1
        refused = r.kind == "review"
        key = idempotency_key(r.workflow_id, "notify_approver")
        payload = f'{{"to": "{r.approver}", "text": "Invoice {r.invoice} awaits your approval"}}'
        yield (
            "\t".join(
                (
                    str(outbox_id),
                    "notify_approver",
                    key,
                    payload,
                    "failed" if refused else "delivered",
                    "1",
                    "0",
                    NULL,
                    NULL,
                    "",
                    NULL,
                    "1",
                    "" if refused else f"msg_{r.id}",
                    "permanent" if refused else "",
                    "notify approver: HTTP 403 forbidden" if refused else "",
                    ts(r.created + 1.5),
                    NULL if refused else ts(r.created + 2.0),
                    ts(r.updated),
                    str(r.id),
                    NULL,
                )
            )
            + "\n"
        )


OUTBOX_COLUMNS = (
    "id, step_name, idempotency_key, payload, state, attempts, budget_start_attempt, budget_started_at, "
    "next_attempt_at, claimed_by, claimed_until, claim_generation, provider_ref, last_error_kind, last_error, "
    "created_at, delivered_at, updated_at, run_id, dispatched_at"
)


# --- loading -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schema:
    """The big tables' key constraints and indexes, as the migrations created them."""

    constraints: list[tuple[str, str, str, str]]  # (table, name, definition, contype)
    indexes: list[tuple[str, str]]  # (name, CREATE INDEX …)


def read_schema(conn: psycopg.Connection) -> Schema:
    tables = list(BIG_TABLES)
    constraints = conn.execute(
        """SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid), contype FROM pg_constraint
           WHERE contype IN ('p', 'u', 'f')
             AND (conrelid::regclass::text = ANY(%s) OR confrelid::regclass::text = ANY(%s))
           ORDER BY conrelid::regclass::text, conname""",
        (tables, tables),
    ).fetchall()
    indexes = conn.execute(
        """SELECT i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid) FROM pg_index i
           WHERE i.indrelid::regclass::text = ANY(%s)
             AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid AND c.contype IN ('p', 'u'))
           ORDER BY 1""",
        (tables,),
    ).fetchall()
    return Schema(constraints=constraints, indexes=indexes)


def drop_schema(conn: psycopg.Connection, schema: Schema) -> None:
    for contype in ("f", "u", "p"):
        for table, name, _, kind in schema.constraints:
            if kind == contype:
                conn.execute(
                    sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(sql.Identifier(table), sql.Identifier(name))
                )
    for name, _ in schema.indexes:
        conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(name)))


def restore_schema(conn: psycopg.Connection, schema: Schema) -> None:
    conn.execute("SET maintenance_work_mem = '1GB'")
    conn.execute("SET max_parallel_maintenance_workers = 2")
    for contype in ("p", "u"):
        for table, name, definition, kind in schema.constraints:
            if kind == contype:
                _timed(f"{name}", lambda t=table, n=name, d=definition: _add_constraint(conn, t, n, d))
    for name, definition in schema.indexes:
        _timed(name, lambda d=definition: conn.execute(d))
    for table, name, definition, kind in schema.constraints:
        if kind == "f":
            _timed(name, lambda t=table, n=name, d=definition: _add_constraint(conn, t, n, d))


def _add_constraint(conn: psycopg.Connection, table: str, name: str, definition: str) -> None:
    conn.execute(
        sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} ").format(sql.Identifier(table), sql.Identifier(name))
        + sql.SQL(definition)  # type: ignore[arg-type]  # a definition PostgreSQL itself printed
    )


def _timed(what: str, work: Callable[[], object]) -> None:
    started = time.perf_counter()
    work()
    log(f"  {what}: {time.perf_counter() - started:.1f}s")


TYPE_DEFAULTS = {
    "smallint": "0",
    "integer": "0",
    "bigint": "0",
    "numeric": "0",
    "boolean": "false",
    "character varying": "''",
    "text": "''",
    "jsonb": "'{}'",
    "json": "'{}'",
    "timestamp with time zone": "now()",
    "date": "current_date",
}


def columns_to_default(conn: psycopg.Connection, table: str, columns: str) -> list[tuple[str, str]]:
    """NOT NULL columns without a database default that the seed does not write (added by a
    migration newer than this file): each gets its type's zero value during the COPY."""
    given = {c.strip() for c in columns.split(",")}
    rows = conn.execute(
        """SELECT column_name, data_type FROM information_schema.columns
           WHERE table_name = %s AND is_nullable = 'NO' AND column_default IS NULL AND is_identity = 'NO'""",
        (table,),
    ).fetchall()
    missing = [(name, kind) for name, kind in rows if name not in given]
    for name, kind in missing:
        if kind not in TYPE_DEFAULTS:
            raise SystemExit(f"seed: {table}.{name} ({kind}) is new and NOT NULL; teach bench/seed.py about it")
    return missing


def copy_table(conn: psycopg.Connection, table: str, columns: str, rows: Iterator[str], chunk: int = 2000) -> int:
    """TRUNCATE and COPY … (FREEZE) in one transaction; returns the number of rows."""
    started = time.perf_counter()
    n = 0
    with conn.transaction():
        missing = columns_to_default(conn, table, columns)
        for name, kind in missing:
            log(f"  {table}.{name} is not written by the seed: {TYPE_DEFAULTS[kind]} for every row")
            conn.execute(
                sql.SQL("ALTER TABLE {} ALTER COLUMN {} SET DEFAULT ").format(
                    sql.Identifier(table), sql.Identifier(name)
                )
                + sql.SQL(TYPE_DEFAULTS[kind])  # type: ignore[arg-type]
            )
        if table == audit_chain.TABLE:  # the bench's own database: its owner empties the trail on purpose
            conn.execute(
                sql.SQL("ALTER TABLE {} DISABLE TRIGGER recovery_audit_no_truncate").format(sql.Identifier(table))
            )
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(table)))
        if table == audit_chain.TABLE:
            conn.execute(
                sql.SQL("ALTER TABLE {} ENABLE TRIGGER recovery_audit_no_truncate").format(sql.Identifier(table))
            )
        if table == "recovery_workflowrun":  # its insert trigger fills recovery_runsearch again (migration 0019)
            conn.execute("TRUNCATE recovery_runsearch")
        if table == audit_chain.TABLE:  # the rows carry their chain (audit_rows)
            conn.execute(sql.SQL("ALTER TABLE {} DISABLE TRIGGER recovery_audit_chain").format(sql.Identifier(table)))
        with conn.cursor() as cur:
            statement = sql.SQL("COPY {} ({}) FROM STDIN (FREEZE)").format(sql.Identifier(table), sql.SQL(columns))
            with cur.copy(statement) as copy:  # type: ignore[arg-type]
                buffer: list[str] = []
                for row in rows:
                    buffer.append(row)
                    if len(buffer) >= chunk:
                        copy.write("".join(buffer).encode())
                        n += len(buffer)
                        buffer = []
                if buffer:
                    copy.write("".join(buffer).encode())
                    n += len(buffer)
        if table == audit_chain.TABLE:
            conn.execute(sql.SQL("ALTER TABLE {} ENABLE TRIGGER recovery_audit_chain").format(sql.Identifier(table)))
        for name, _ in missing:
            conn.execute(
                sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP DEFAULT").format(
                    sql.Identifier(table), sql.Identifier(name)
                )
            )
    elapsed = time.perf_counter() - started
    log(f"  {table}: {n:,} rows in {elapsed:.1f}s ({n / max(elapsed, 1e-9):,.0f} rows/s)")
    return n


def human_user(conn: psycopg.Connection, now: float) -> int:
    row = conn.execute(
        """INSERT INTO auth_user (password, is_superuser, username, first_name, last_name, email, is_staff,
                                  is_active, date_joined)
           VALUES ('!', false, %s, 'Alice', 'Ops', 'alice@example.com', false, true, %s)
           ON CONFLICT (username) DO UPDATE SET is_active = true RETURNING id""",
        (HUMAN_USERNAME, datetime.fromtimestamp(now, UTC)),
    ).fetchone()
    assert row is not None
    return int(row[0])


def seed(db_url: str, size: Size, *, days: float = 90.0, rng_seed: int = 1, now: float | None = None) -> dict:
    """Load ``size`` into the migrated database at ``db_url``; returns the seed info."""
    plan = Plan.build(size, days=days, seed=rng_seed, now=now or time.time())
    started = time.perf_counter()
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        schema = read_schema(conn)
        drop_schema(conn, schema)
        user_id = human_user(conn, plan.now)
        log(f"seeding {size.runs:,} runs, {size.steps:,} steps, {size.audit:,} audit events")
        copy_table(conn, "recovery_workflowrun", RUN_COLUMNS, run_rows(plan))
        copy_table(conn, "recovery_stepexecution", STEP_COLUMNS, step_rows(plan))
        copy_table(conn, "recovery_auditevent", AUDIT_COLUMNS, audit_rows(plan, user_id))
        copy_table(conn, "recovery_historicalworkflowrun", HISTORY_COLUMNS, history_rows(plan, user_id))
        copy_table(conn, "recovery_modeldecision", DECISION_COLUMNS, decision_rows(plan))
        copy_table(conn, "recovery_outboxmessage", OUTBOX_COLUMNS, outbox_rows(plan))
        log("recreating indexes and constraints")
        restore_schema(conn, schema)
        for table, column in [(t, "id") for t in BIG_TABLES if "historical" not in t] + [
            ("recovery_historicalworkflowrun", "history_id")
        ]:
            conn.execute(
                sql.SQL("SELECT setval(pg_get_serial_sequence(%s, %s), (SELECT max({}) FROM {}))").format(
                    sql.Identifier(column), sql.Identifier(table)
                ),
                (table, column),
            )
        log("VACUUM (ANALYZE)")
        for table in BIG_TABLES:
            conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(sql.Identifier(table)))
        info = {**plan.info(), "seconds": round(time.perf_counter() - started, 1), "human_user_id": user_id}
        conn.execute("CREATE TABLE IF NOT EXISTS bench_seed_info (key text PRIMARY KEY, value jsonb NOT NULL)")
        conn.execute(
            "INSERT INTO bench_seed_info VALUES ('seed', %s) ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
            (json.dumps(info),),
        )
    log(f"seeded in {info['seconds']:.0f}s")
    return info


def seed_info(db_url: str) -> dict | None:
    """The seed info of an already seeded database, or None."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass('bench_seed_info') IS NOT NULL").fetchone()
        if not exists or not exists[0]:
            return None
        row = conn.execute("SELECT value FROM bench_seed_info WHERE key = 'seed'").fetchone()
    return row[0] if row else None


# --- a database for one benchmark ------------------------------------------------------------


@dataclass
class BenchDatabase:
    """A seeded database: a throw-away one (dropped by ``close`` unless ``keep``), or the one
    named by ``--reuse`` (seeded if not yet, never dropped)."""

    admin_url: str
    name: str
    keep: bool
    info: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return database_url(self.admin_url, self.name)

    @classmethod
    def open(
        cls, admin_url: str, size: Size, *, prefix: str, reuse: str | None, keep: bool, days: float, rng_seed: int
    ) -> BenchDatabase:
        name = reuse or f"{prefix}_{os.getpid()}"
        db = cls(admin_url=admin_url, name=name, keep=keep or reuse is not None)
        if reuse and database_exists(admin_url, name) and (info := seed_info(db.url)):
            log(f"reusing {name}: {info['runs']:,} runs, {info['audit']:,} audit events (seeded {info['seeded_at']})")
            db.info = info
            return db
        if not database_exists(admin_url, name):
            create_database(admin_url, name)
        try:
            log(f"migrating {name}")
            manage(db.url, "migrate", "--noinput")
            db.info = seed(db.url, size, days=days, rng_seed=rng_seed)
        except BaseException:
            db.close()
            raise
        return db

    def close(self) -> None:
        if self.keep:
            log(f"kept database {self.name} ({self.url})")
        else:
            drop_database(self.admin_url, self.name)
            log(f"dropped database {self.name}")


def add_database_arguments(parser: argparse.ArgumentParser, *, default_runs: int, prefix: str) -> None:
    parser.add_argument(
        "--database-url",
        default=DEFAULT_ADMIN_URL,
        help="an admin connection to the PostgreSQL server to use; its database is never written",
    )
    parser.add_argument("--runs", type=int, default=default_runs, help=f"runs to seed ({default_runs:,})")
    parser.add_argument("--audit", type=int, help="audit events to seed (default 10 per run)")
    parser.add_argument("--days", type=float, default=90.0, help="the runs' creation times span this many days (90)")
    parser.add_argument("--seed", type=int, default=1, help="random seed of the data (1)")
    parser.add_argument("--keep", action="store_true", help=f"keep the throw-away database ({prefix}_<pid>)")
    parser.add_argument(
        "--reuse", metavar="NAME", help="use database NAME: create, migrate and seed it if needed; never drop it"
    )


def open_from_args(args: argparse.Namespace, *, prefix: str) -> BenchDatabase:
    size = Size(runs=args.runs, audit=args.audit or 10 * args.runs)
    return BenchDatabase.open(
        args.database_url, size, prefix=prefix, reuse=args.reuse, keep=args.keep, days=args.days, rng_seed=args.seed
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_database_arguments(parser, default_runs=20_000, prefix="bench_seed")
    args = parser.parse_args()
    if not args.reuse and not args.keep:
        parser.error("give --reuse NAME or --keep: a seed that is dropped at once is of no use")
    db = open_from_args(args, prefix="bench_seed")
    print(json.dumps({"database": db.name, **db.info}, default=str))
    db.close()


if __name__ == "__main__":
    main()
