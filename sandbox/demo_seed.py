"""``seed_demo``'s domain function: which generation of the demo to play, what a reset closes
first (the previous generation's unfinished runs in the engine, its open approval tasks in the
simulated tracker), and the conditions under which the seed refuses to play."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.management.base import CommandError
from django.db import connections

from recovery.accounts import ROLES, Actor, create_operator
from recovery.engine import transitions
from recovery.errors import InvalidTransition
from recovery.models import WorkflowRun
from sandbox import demo_logins, faults
from sandbox.demo_player import Seeder, temporary_environ, temporary_settings
from sandbox.demo_scenarios import DISPUTES, MODEL_SCRIPT, SCENARIOS, dispute_ids, generation_ids, invoice_id
from sandbox.demo_server import sandbox_server
from sandbox.models import Fault

# The dropped answers cost one read timeout each; one second is plenty on one machine.
SEED_HTTP_TIMEOUT = 1.0


# Held while a seed plays, so that two seeds never play at once.
def lock_path() -> Path:
    """The seed's lock file, one per engine database: two seeds of the same database exclude each
    other; seeds of different databases (a test worker's own, say) do not. An in-memory database
    is its process's own."""
    db = connections["default"].settings_dict
    name = str(db.get("NAME"))
    if "memory" in name:
        name += f":{os.getpid()}"
    key = hashlib.sha256(f"{db.get('HOST')}:{db.get('PORT')}:{name}".encode()).hexdigest()[:12]
    return settings.BASE_DIR / "var" / f"seed_demo-{key}.lock"


@dataclass(frozen=True)
class Seeded:
    generation: int
    states: Counter
    new: int
    terminated: int = 0
    tasks_done: int = 0  # the earlier generations' approval tasks the reset closed in the tracker


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
    ``reset``, first terminate the current generation's unfinished runs, close the earlier
    generations' open approval tasks in the simulated tracker (done, as their approvers would:
    the same invoices played again are not duplicates of open ones), and play a new generation.
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
                user, _, _ = create_operator(
                    username=role,
                    group=role,
                    password=demo_logins.demo_password(),
                    actor=Actor.command("seed_demo"),
                    reason=demo_logins.REASON,
                    verified=demo_logins.verified(role),
                )
                demo_logins.remember(user)
        terminated = tasks_done = 0
        if pending or disputes:
            supervisor = _supervisor(username)
            if generation != previous:
                reason = f"demo reset by {supervisor.get_username()}: played again as generation {generation}"
                terminated = _close(generation_ids(previous) + dispute_ids(previous), supervisor, reason)
                tasks_done = faults.finish_tasks(
                    (s.tenant, invoice_id(s.invoice_id, earlier)) for s in SCENARIOS for earlier in range(1, generation)
                )
            url = (sandbox_url or settings.SANDBOX_URL).rstrip("/")
            timeout = min(settings.RECOVERY_HTTP_TIMEOUT, SEED_HTTP_TIMEOUT)
            with (
                sandbox_server(url) as served,
                # The seed is the executor of its runs: nothing is handed to Celery meanwhile.
                temporary_settings(SANDBOX_URL=served, RECOVERY_HTTP_TIMEOUT=timeout, RECOVERY_EXECUTOR="embedded"),
                temporary_environ(),
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
    return Seeded(
        generation=generation,
        states=states,
        new=len(pending) + len(disputes),
        terminated=terminated,
        tasks_done=tasks_done,
    )


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
    """An exclusive lock on a file of the engine's database (``lock_path``): a second seed (a double click
    on the demo page's reset) is refused instead of playing the same scenarios twice."""
    lock = lock_path()
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as handle:
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
