"""Soak: the whole system under real process death (``make soak``).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/recovery .venv/bin/python bench/soak.py

It runs the real thing — the console's server (which also serves the simulated systems under
/sandbox/), two or more Celery workers and beat — pushes N invoice events at it, each delivered
twice and through a mix of paths (the Celery task ``recovery.tasks.start_run``, ``POST
/api/events/invoice``, ``manage.py start_workflow``), and breaks things while it works: faults
armed on the simulated services with ``manage.py sandbox fault`` every second or two, a random
worker that is up SIGKILLed (its whole process group) every SOAK_KILL_EVERY seconds and
restarted, Redis killed and restarted once mid-run (whatever it held is lost; the sweeper must
recover it), and the engine's database restarted once, at two thirds of the load (``pg_ctl
restart``, ``-m fast`` for an even seed, ``-m immediate`` — a crash — for an odd one), with
steps in flight: every session ends, the workers' kept connections with them.
Then it clears the remaining faults, lets the workers finish, and checks what must hold: one run
per event, no duplicate side effect, every run completed or in an explicit review state, nothing
``running`` past its lease, every completed run with its three remote references and exactly one
task, message and ledger entry, no object in the simulated systems that its step says never
happened, and an audit trail consistent with each run's state. Each violation is printed on its
own line (``VIOLATION …``); the last line is the summary:

    soak: runs=<N> completed=<n> review=<n> kills=<n> faults=<n> db_restarts=<n> duplicates=<n>
          stuck=<n> redelivered=<n> executor_errors=<n> violations=<n> elapsed=<s>s      (one line)

``executor_errors`` counts runs the engine sent to review with "executor error: …", which the
engine itself treats as a bug in a workflow or in the engine: an explicit review state, so not a
violation by the rules above, but printed (stderr) with the run and its reason. A database
restart is infrastructure, not a workflow fault (``recovery.errors.DatabaseUnavailable``: the
executor lets go of the run, the Celery tasks retry with backoff): it must not add any.

Exit status: 0 no violation, 1 violations, 2 bad set-up (DATABASE_URL not PostgreSQL,
redis-server not on PATH, no PostgreSQL server binaries for the engine's own cluster, a
database that cannot be created or migrated).

Environment: SOAK_RUNS (500), SOAK_KILL_EVERY (3 seconds), SOAK_TIMEOUT (seconds to wait for
quiescence after the load; max(600, N)), SOAK_KEEP=1 (keep the databases and the logs),
SOAK_WORKERS (3), SOAK_SEED (random), SOAK_LOAD_SECONDS (how long events keep arriving;
max(20, N / 5): five events a second, each delivered twice).

Backlog. The producers outrun three workers SIGKILLed every 3 s on two cores: the broker queue
grows during the load (its length is in the progress lines) and drains afterwards. It stays
bounded because the sweeper queues a task for a run only when none is queued for it already
(``dispatched_at``); a task lost with a killed worker or the Redis restart is queued again after
RECOVERY_REDISPATCH_SECONDS (20 here). Workers keep their database connections
(DATABASE_CONN_MAX_AGE=60); every child runs with DJANGO_DEBUG=0, as in production.

Isolation. The soak restarts the engine's database, so that database lives on a PostgreSQL
cluster of its own (tests/support/pgcluster.py: ``initdb`` in a temporary directory, a free port
on 127.0.0.1, run as the ``postgres`` OS user when the soak is root), never on the machine's
shared server: ``soak_<pid>`` is created there, and the cluster is stopped and removed at the
end, also on failure or SIGTERM (SOAK_KEEP=1: stopped cleanly and its directory kept). The
simulated systems' database stays on the PostgreSQL *server* of DATABASE_URL, and only the
server is used, never the databases named in DATABASE_URL or SANDBOX_DATABASE_URL: a throw-away
``soak_sandbox_<pid>`` is created (through the server's ``postgres`` maintenance database),
migrated, and dropped at the end, also on failure (``DROP DATABASE … WITH (FORCE)``), unless
SOAK_KEEP=1. It is not restarted on purpose: the tasks, messages and ledger services stand for
other companies' systems, whose storage does not go down with the engine's; and the sandbox is
the evidence the checks count duplicates in. (Restarting it too would make the simulated
systems answer 500 for a few seconds: what a ``unavailable`` fault already does.)
CELERY_BROKER_URL from the environment is ignored on purpose: the soak kills and restarts its
broker, so it starts a Redis of its own on a free port (bound to 127.0.0.1, no persistence) and
never touches the machine's Redis. Every server binds 127.0.0.1; every child process runs in its
own process group and is stopped at the end.

Events lost with the broker. A ``start_run`` message that Redis loses (restart), that a
SIGKILLed worker had taken, or that a worker consumed while the database was restarting (the
task fails and is acknowledged: ``start_run`` does not retry) can only be recovered by its
sender: no run exists yet, so the sweeper cannot know about it. The producers therefore behave
like an at-least-once queue: an event with no run is delivered again through the Celery task
when its last delivery preceded the broker restart, or when the broker is drained and its last
delivery is 15 s old (then 30 s, 60 s …); counted as ``redelivered``. Runs, steps and outbox
messages, once committed, are the engine's to recover: nothing else is ever re-sent.

Audit check. "The last audit event's ``after.run`` equals the run's state" looks at the last
event (in insertion order, which is serialised by the run's row lock) that records a run state:
outbox delivery events (``outbox_delivered``, ``outbox_retry``, ``outbox_fail``, ``outbox_cancel``)
describe the message, not the run, and carry no ``run`` key. The first event must be the one
``start``.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
MANAGE = str(ROOT / "manage.py")

ACTIVE_STATES = ("pending", "running", "waiting", "compensating")
REVIEW_STATES = ("needs_review", "failed", "compensation_failed", "compensated", "terminated")
STEPS = (
    "read_invoice",
    "classify",
    "check_duplicate",
    "create_approval_task",
    "notify_approver",
    "watch_approval_task",
    "approver_decision",
    "post_ledger_entry",
)
EFFECT_STEPS = ("create_approval_task", "notify_approver", "post_ledger_entry")
# A step state that admits the effect may exist in the remote system.
EFFECT_MAY_EXIST = ("succeeded", "unknown", "running", "compensating", "compensated", "compensation_failed")

# What chaos arms. `tasks cancel` is faultable too, but only a compensation cancels a task and
# the invoice workflow compensates on an operator's word only: such a fault would never fire.
FAULT_TARGETS = (("tasks", "create"), ("messages", "send"), ("ledger", "post"))
FAULT_MODES = (
    ("commit_then_drop", 3),
    ("late_commit", 3),
    ("rate_limit", 2),
    ("unavailable", 2),
    ("fail_before_commit", 2),
    ("slow", 2),
)
SLOW_DELAYS_MS = (200, 500, 900, 1500, 2500)  # some past the adapters' 1 s timeout: the answer is late
# The receiver commits after the caller gave up (1 s), well inside the in-flight bound the soak
# configures (SETTLE_SECONDS + the 1 s timeout): a look-up before then must not be taken as absence.
SETTLE_SECONDS = 15
LATE_DELAYS_MS = (1500, 4000, 8000)
REDELIVER_AFTER = 15.0
DB_RESTART_MODES = ("fast", "immediate")  # pg_ctl restart -m …, by the seed's parity

VENDORS = (
    "Acme Office Supplies GmbH",
    "Globex IT Services Ltd",
    "Initech Software AB",
    "Umbrella Travel AG",
    "Stark Hardware BV",
    "Wayne Consulting LLP",
    "Hooli Cloud Inc.",
    "Contoso Facilities SARL",
)
ITEMS = (
    "ergonomic office chairs",
    "27-inch monitors",
    "laptops with docking stations",
    "annual software licence seats",
    "train tickets Paris-Berlin",
    "hotel nights in Lyon",
    "consulting days (data migration)",
    "boxes of printer paper",
    "cloud hosting subscription months",
    "standing desks",
)
CURRENCIES = ("EUR", "EUR", "EUR", "USD", "GBP", "CHF")


class SetupError(Exception):
    """The soak cannot run here (exit status 2)."""


@dataclass(frozen=True)
class Config:
    runs: int
    kill_every: float
    timeout: float
    keep: bool
    workers: int
    seed: int
    load_seconds: float

    @classmethod
    def from_env(cls) -> Config:
        runs = _env_number("SOAK_RUNS", 500, int, minimum=1)
        return cls(
            runs=runs,
            kill_every=_env_number("SOAK_KILL_EVERY", 3.0, float, minimum=0.5),
            timeout=_env_number("SOAK_TIMEOUT", float(max(600, runs)), float, minimum=1),
            keep=os.environ.get("SOAK_KEEP", "").strip().lower() in {"1", "true", "yes", "on"},
            workers=_env_number("SOAK_WORKERS", 3, int, minimum=2),
            seed=_env_number("SOAK_SEED", random.randrange(1, 1_000_000), int, minimum=0),
            load_seconds=_env_number("SOAK_LOAD_SECONDS", max(20.0, runs / 5), float, minimum=1),
        )


def _env_number(name: str, default, cast, *, minimum):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = cast(raw)
    except ValueError:
        raise SetupError(f"{name} must be a number, got {raw!r}") from None
    if value < minimum:
        raise SetupError(f"{name} must be at least {minimum}, got {raw!r}")
    return value


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# --- the databases ----------------------------------------------------------------------


def postgres_server(database_url: str | None) -> tuple[str, str]:
    """(a libpq URL of the server's maintenance database, a URL template with ``{db}``)."""
    parts = urlsplit(database_url or "")
    if parts.scheme not in ("postgres", "postgresql", "pgsql") or not parts.netloc:
        raise SetupError("soak needs PostgreSQL: set DATABASE_URL=postgres://…")
    template = urlunsplit(("postgres", parts.netloc, "/{db}", parts.query, ""))
    return database_url_for(template, "postgres"), template


def database_url_for(template: str, name: str) -> str:
    return template.replace("/{db}", f"/{name}", 1)


def redact(url: str) -> str:
    """A database URL fit to print: without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def pgcluster():
    """tests/support/pgcluster.py (the repository's root on sys.path: ``bench/soak.py`` is run as
    a script, so only bench/ is there)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.support import pgcluster as module

    return module


def pg_connect(url: str):
    import psycopg

    return psycopg.connect(url.replace("postgres://", "postgresql://", 1), autocommit=True, connect_timeout=10)


# --- child processes --------------------------------------------------------------------


class Child:
    """A long-running child in its own process group, its output appended to a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path):
        self.name, self.argv, self.env, self.log_path = name, argv, env, log_path
        self.popen: subprocess.Popen | None = None
        self.starts = 0
        self.log_offset = 0

    def start(self) -> None:
        with open(self.log_path, "ab") as out:
            out.write(f"\n--- soak: start #{self.starts + 1} at {time.strftime('%H:%M:%S')}\n".encode())
            out.flush()
            self.log_offset = out.tell()
            self.popen = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.starts += 1

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def ready(self) -> bool:
        """A Celery worker that said "ready." since it was last started."""
        if not self.alive():
            return False
        with open(self.log_path, "rb") as log_file:
            log_file.seek(self.log_offset)
            return b" ready." in log_file.read(65536)

    def kill(self) -> None:
        """SIGKILL the whole process group (the worker and its pool children)."""
        p = self.popen
        if p is None or p.poll() is not None:
            return
        _killpg(p.pid, signal.SIGKILL)
        p.wait()
        _killpg(p.pid, signal.SIGKILL)  # any member left, right after the leader was reaped

    def stop(self, grace: float = 10.0) -> None:
        p, self.popen = self.popen, None
        if p is None:
            return
        if p.poll() is None:
            _killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                _killpg(p.pid, signal.SIGKILL)
                p.wait()
            _killpg(p.pid, signal.SIGKILL)  # any member left, right after the leader was reaped


# --- the soak ---------------------------------------------------------------------------


def make_events(n: int, rng: random.Random) -> list[dict]:
    events = []
    for k in range(n):
        currency = rng.choice(CURRENCIES)
        quantity = rng.randint(1, 60)
        unit = rng.choice((19.9, 45.0, 120.0, 249.99, 480.0, 1299.0))
        total = round(quantity * unit * rng.uniform(0.8, 1.25), 2)
        day = f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        due = rng.choice(("Total due", "Amount payable:", "Total", "Please pay"))
        text = (
            f"INVOICE {k:05d} from {rng.choice(VENDORS)}, dated {day}. "
            f"{quantity} {rng.choice(ITEMS)}, delivered and accepted. "
            f"Payment within {rng.choice((14, 30, 45))} days. {due} {currency} {total:,.2f}"
        )
        events.append({"tenant": f"soak-{k % 7}", "invoice_id": f"inv-{k}", "text": text})
    return events


def workflow_id(event: dict) -> str:
    return f"invoice:{event['tenant']}:{event['invoice_id']}"


def delivery_path(k: int, copy: int) -> str:
    """Most deliveries through the Celery task, some through the HTTP API, a few through the
    command; the two copies of one event often take different paths."""
    slot = (k + 11 * copy) % 20
    return "celery" if slot < 14 else "api" if slot < 19 else "command"


class Soak:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.pid = os.getpid()
        self.admin_url, self.url_template = postgres_server(os.environ.get("DATABASE_URL"))
        if not shutil.which("redis-server"):
            raise SetupError("soak needs redis-server on PATH (apt-get install redis-server)")
        module = pgcluster()
        try:
            self.pg_bindir = module.check_available()
        except module.ClusterUnavailable as exc:
            raise SetupError(f"soak needs PostgreSQL's server binaries for the engine's own cluster: {exc}") from None
        self.db_name = f"soak_{self.pid}"
        self.sandbox_db_name = f"soak_sandbox_{self.pid}"
        self.db_url = ""  # on the soak's own cluster, once it is up (its port is free only then)
        self.sandbox_db_url = database_url_for(self.url_template, self.sandbox_db_name)
        self.created_dbs: list[str] = []  # on the server of DATABASE_URL
        self.cleanup = ExitStack()  # the cluster
        self.pg = None
        # A restart (the chaos thread) and the final stop (the main thread, on SIGTERM too) never
        # overlap: a ``pg_ctl start`` finishing after the stop would leave a server running.
        self.pg_lock = threading.Lock()
        self.pg_closed = False
        self.tmp = Path(tempfile.mkdtemp(prefix="soak-"))
        self.redis_port = free_port()
        self.server_port = free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.env = {k: v for k, v in os.environ.items() if k != "RECOVERY_FAILPOINTS"}
        callback_secret = secrets.token_urlsafe(32)
        self.approved: dict[str, float] = {}  # run → when its task was last approved in the tracker
        self.env.update(
            SANDBOX_DATABASE_URL=self.sandbox_db_url,
            CELERY_BROKER_URL=self.redis_url,
            RECOVERY_EXECUTOR="celery",
            RECOVERY_LEASE_SECONDS="5",
            RECOVERY_SWEEP_SECONDS="1",
            # A task a SIGKILLed worker had reserved is lost with it: re-sent after 20 s, not 60.
            RECOVERY_REDISPATCH_SECONDS="20",
            RECOVERY_HTTP_TIMEOUT="1",
            RECOVERY_SETTLE_SECONDS=str(SETTLE_SECONDS),
            SANDBOX_URL=f"http://127.0.0.1:{self.server_port}",
            DJANGO_DEBUG="0",  # as in production: no query log kept in every worker
            DJANGO_SECRET_KEY=secrets.token_urlsafe(32),
            DJANGO_SECURE_SSL_REDIRECT="0",  # plain HTTP on the loopback: no TLS to redirect to
            SANDBOX_API_KEY=secrets.token_urlsafe(32),  # production settings close the sandbox without one
            DJANGO_SETTINGS_MODULE="config.settings",
            PORT=str(self.server_port),
            # Invoice v3: above INVOICE_APPROVAL_WAIT_ABOVE a run waits for its approver, whom the
            # tracker's signed callback (to this server) answers for (approve_waiting).
            RECOVERY_CONSOLE_URL=f"http://127.0.0.1:{self.server_port}",
            RECOVERY_EVENT_SIGNING_SECRET=callback_secret,
            SANDBOX_CALLBACK_SECRET=callback_secret,
            MODEL_PROVIDER="rules",
            PYTHONUNBUFFERED="1",
        )
        self.redis: Child | None = None
        self.server: Child | None = None
        self.beat: Child | None = None
        self.workers: list[Child] = []
        self.transient: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.chaos_stop = threading.Event()
        self.events = make_events(cfg.runs, self.rng)
        self.last_delivery: dict[int, float] = {}
        self.delivered = Counter()  # path → deliveries that the path acknowledged
        self.delivery_retries = Counter()  # path → failed attempts that were retried
        self.redelivered: list[str] = []
        self.kills = 0
        self.faults = 0
        self.fault_units = Counter()  # mode → units armed
        self.fault_left = Counter()  # mode → units never consumed (cleared at the end)
        self.forbidden_left = max(3, cfg.runs // 50)
        self.redis_restarts = 0
        self.redis_restarted_at = 0.0
        self.db_restarts = 0
        self.chaos_failures: list[str] = []  # a restart that did not happen: a violation
        self.auto_pauses: list[str] = []  # steps that paused themselves, released once the chaos stopped
        self.token = ""
        self.started = time.monotonic()
        self.load_started = 0.0
        self.worker_deaths: list[str] = []
        self.stats: dict | None = None
        self.executor_errors: list[str] = []

    # --- set-up -------------------------------------------------------------------------

    def setup(self) -> None:
        log(f"seed {self.cfg.seed}; runs {self.cfg.runs}; logs in {self.tmp}")
        self.start_cluster()
        self.create_databases()
        self.start_redis()
        self.migrate()
        # --may-pause: the soak's on-call releases a step that paused itself (pause_after).
        rc, out = self.command([PY, MANAGE, "create_api_token", "soak", "--workflow", "invoice", "--may-pause"])
        if rc != 0 or not out.strip():
            raise SetupError(f"create_api_token failed: {out.strip()[-300:]}")
        self.token = out.strip().splitlines()[-1]
        # This process sends start_run itself: the same settings as the children, the soak's broker.
        os.environ.update(self.env)
        self.celery_app().conf.broker_url  # noqa: B018 - load the configuration once, before the threads
        self.start_server()
        self.workers = [self.worker(i + 1) for i in range(self.cfg.workers)]
        for w in self.workers:
            w.start()
        self.beat = Child(
            "beat",
            [
                PY,
                "-m",
                "celery",
                "-A",
                "config",
                "beat",
                "-s",
                str(self.tmp / "beat"),
                "--pidfile",
                str(self.tmp / "beat.pid"),
                "-l",
                "INFO",
            ],
            self.env,
            self.tmp / "beat.log",
        )
        self.beat.start()
        self.wait_workers_ready()

    def start_cluster(self) -> None:
        """The engine's database, on a throw-away cluster of the soak's own (it is restarted)."""
        module = pgcluster()
        try:
            self.pg = self.cleanup.enter_context(module.cluster(skip=False, keep=self.cfg.keep))
            self.pg.create_database(self.db_name)
        except (module.ClusterUnavailable, RuntimeError, OSError) as exc:
            log(f"the engine's cluster: {exc}")
            raise SetupError(f"cannot start the soak's own PostgreSQL cluster: {exc}".splitlines()[0]) from None
        self.db_url = self.pg.url(self.db_name)
        self.env["DATABASE_URL"] = self.db_url
        log(f"engine database {self.db_name} on a cluster of its own: 127.0.0.1:{self.pg.port} ({self.pg.bindir})")

    def stop_cluster(self) -> None:
        """Stopped and removed (SOAK_KEEP=1: stopped cleanly, kept); its server log goes with the soak's."""
        pg = self.pg
        if pg is not None and pg.log.exists():
            try:
                shutil.copyfile(pg.log, self.tmp / "postgres.log")
            except OSError:
                pass
        try:
            with self.pg_lock:
                self.pg_closed = True
                self.cleanup.close()
        except Exception as exc:
            log(f"could not stop the engine's cluster in {pg and pg.base}: {str(exc).splitlines()[0]}")
            return
        if pg is not None and self.cfg.keep:
            as_user = "runuser -u postgres -- " if os.geteuid() == 0 else ""
            log(
                f"engine database kept: {self.db_name} in a stopped cluster, {pg.data}; start it with "
                f"{as_user}{pg.bindir / 'pg_ctl'} -D {pg.data} -l {pg.log} start, then {pg.url(self.db_name)}"
            )

    def create_databases(self) -> None:
        """The simulated systems' database, on the server of DATABASE_URL (never restarted)."""
        from psycopg import sql

        try:
            with pg_connect(self.admin_url) as conn:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.sandbox_db_name)))
                self.created_dbs.append(self.sandbox_db_name)
        except Exception as exc:
            where = redact(self.admin_url)
            raise SetupError(f"cannot create the soak database on {where}: {exc}".splitlines()[0]) from None
        log(f"created database {self.sandbox_db_name} on {redact(self.admin_url).rsplit('/', 1)[0]}")

    def drop_databases(self) -> None:
        from psycopg import sql

        if not self.created_dbs:
            return
        try:
            with pg_connect(self.admin_url) as conn:
                for name in list(self.created_dbs):
                    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
                    self.created_dbs.remove(name)
        except Exception as exc:
            log(f"could not drop {', '.join(self.created_dbs)}: {exc}")

    def migrate(self) -> None:
        procs = []
        for extra in ([], ["--database", "sandbox"]):
            out = open(self.tmp / f"migrate{'-sandbox' if extra else ''}.log", "wb")
            procs.append(
                (
                    subprocess.Popen(
                        [PY, MANAGE, "migrate", "--noinput", *extra],
                        cwd=ROOT,
                        env=self.env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    ),
                    out,
                )
            )
        for p, out in procs:
            self.transient.add(p)
            rc = p.wait(300)
            self.transient.discard(p)
            out.close()
            if rc != 0:
                raise SetupError(f"migrate failed (see {out.name}): " + Path(out.name).read_text()[-300:].strip())
        log("migrated both databases")

    def start_redis(self) -> None:
        if self.redis is None:
            self.redis = Child(
                "redis",
                [
                    "redis-server",
                    "--port",
                    str(self.redis_port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.tmp),
                ],
                self.env,
                self.tmp / "redis.log",
            )
        self.redis.start()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.redis_ping():
                return
            if not self.redis.alive():
                break
            time.sleep(0.05)
        raise SetupError(f"redis-server did not start on port {self.redis_port} (see {self.redis.log_path})")

    def redis_ping(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.redis_port, socket_timeout=1, socket_connect_timeout=1).ping())
        except redis.RedisError:
            return False

    def queue_length(self) -> str:
        import redis

        try:
            return str(redis.Redis(port=self.redis_port, socket_timeout=1, socket_connect_timeout=1).llen("celery"))
        except redis.RedisError:
            return "-"

    def start_server(self) -> None:
        self.server = Child(
            "server",
            [PY, MANAGE, "runserver", f"127.0.0.1:{self.server_port}", "--noreload"],
            self.env,
            self.tmp / "server.log",
        )
        self.server.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.server_port}/login/", timeout=2) as response:
                    if response.status == 200:
                        log(f"server up on 127.0.0.1:{self.server_port}")
                        return
            except (urllib.error.URLError, OSError):
                pass
            if not self.server.alive():
                break
            time.sleep(0.2)
        raise SetupError(f"the server did not answer /login/ with 200 (see {self.server.log_path})")

    def worker(self, n: int) -> Child:
        argv = [
            PY,
            "-m",
            "celery",
            "-A",
            "config",
            "worker",
            "-c",
            "2",
            "-n",
            f"soak{n}@%h",
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
            "-l",
            "INFO",
        ]
        # A worker keeps its database connection between tasks (a new one per task costs a backend start).
        env = {**self.env, "DATABASE_CONN_MAX_AGE": "60"}
        return Child(f"soak{n}", argv, env, self.tmp / f"worker-soak{n}.log")

    def wait_workers_ready(self) -> None:
        deadline = time.monotonic() + 90
        pending = {w.name for w in self.workers}
        while pending and time.monotonic() < deadline:
            for w in self.workers:
                if w.name in pending and w.ready():
                    pending.discard(w.name)
                if not w.alive():
                    raise SetupError(f"worker {w.name} exited at start-up (see {w.log_path})")
            time.sleep(0.2)
        if pending:
            raise SetupError(f"workers not ready after 90 s: {', '.join(sorted(pending))} (see {self.tmp})")
        log(f"{len(self.workers)} workers and beat ready")

    # --- short commands -----------------------------------------------------------------

    def command(self, argv: list[str], timeout: float = 120) -> tuple[int, str]:
        p = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        with self.lock:
            self.transient.add(p)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            return -9, out or ""
        finally:
            with self.lock:
                self.transient.discard(p)
        return p.returncode, out or ""

    # --- load ---------------------------------------------------------------------------

    def schedule(self) -> dict[str, list[tuple[float, int]]]:
        """path → [(seconds after the load starts, event index)], each event twice."""
        plan: dict[str, list[tuple[float, int]]] = defaultdict(list)
        spread = self.cfg.load_seconds * 0.85
        for k in range(self.cfg.runs):
            first = spread * k / max(1, self.cfg.runs)
            # The redelivery: often at once (concurrent with the first), else up to 4 s later.
            second = first if self.rng.random() < 0.35 else first + self.rng.uniform(0.05, 4.0)
            plan[delivery_path(k, 0)].append((first, k))
            plan[delivery_path(k, 1)].append((second, k))
        return {path: sorted(items) for path, items in plan.items()}

    def producer(self, path: str, items: list[tuple[float, int]]) -> None:
        send = {"celery": self.send_celery, "api": self.send_api, "command": self.send_command}[path]
        state: dict = {}
        try:
            for at, k in items:
                delay = self.load_started + at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                deadline, sent = time.monotonic() + 60, False
                while not sent:
                    try:
                        send(self.events[k], state)
                        sent = True
                    except Exception as exc:  # the broker restarting, the server busy: send again
                        with self.lock:
                            self.delivery_retries[path] += 1
                        if time.monotonic() > deadline:
                            log(f"{path}: gave up delivering {workflow_id(self.events[k])}: {exc}")
                            break
                        drop_connection(state)
                        time.sleep(0.5)
                with self.lock:
                    self.delivered[path] += sent
                    self.last_delivery[k] = time.monotonic()
        finally:
            drop_connection(state)

    def celery_app(self):
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        from config.celery import app

        return app

    def send_celery(self, event: dict, state: dict) -> None:
        app = self.celery_app()
        if state.get("conn") is None:
            state["conn"] = app.connection_for_write(self.redis_url)
        app.send_task("recovery.tasks.start_run", args=["invoice", event], connection=state["conn"])

    def send_api(self, event: dict, state: dict) -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.server_port}/api/events/invoice",
            data=json.dumps(event).encode(),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=15) as response:
            if response.status not in (200, 201):
                raise RuntimeError(f"HTTP {response.status}")

    def send_command(self, event: dict, state: dict) -> None:
        rc, out = self.command([PY, MANAGE, "start_workflow", "invoice", "--input", json.dumps(event)])
        if rc != 0 or out.strip().splitlines()[-1:] != [workflow_id(event)]:
            raise RuntimeError(f"start_workflow exited {rc}: {out.strip()[-200:]}")

    # --- chaos --------------------------------------------------------------------------

    def chaos_faults(self) -> None:
        rng = random.Random(self.cfg.seed + 1)
        index = 0
        forbidden_targets = list(FAULT_TARGETS)
        while not self.chaos_stop.wait(rng.uniform(1.0, 2.0)):
            service, operation = rng.choice(FAULT_TARGETS)
            extra: list[str] = []
            if self.forbidden_left and index % 4 == 1:
                service, operation = forbidden_targets[self.forbidden_left % len(forbidden_targets)]
                mode, times = "forbidden", 1
            else:
                mode = rng.choices([m for m, _ in FAULT_MODES], weights=[w for _, w in FAULT_MODES])[0]
                times = rng.randint(1, 3)
                if mode == "rate_limit":
                    extra = ["--retry-after", str(rng.randint(1, 2))]
                elif mode == "slow":
                    extra = ["--delay-ms", str(rng.choice(SLOW_DELAYS_MS))]
                elif mode == "late_commit":
                    extra = ["--delay-ms", str(rng.choice(LATE_DELAYS_MS))]
            index += 1
            argv = [PY, MANAGE, "sandbox", "fault", service, operation, mode, "--times", str(times), *extra]
            rc, out = self.command(argv)
            if rc == 0:
                with self.lock:
                    self.faults += 1
                    self.fault_units[mode] += times
                    if mode == "forbidden":
                        self.forbidden_left -= 1
            else:
                log(f"sandbox fault failed ({rc}): {out.strip()[-200:]}")

    def chaos_kills(self) -> None:
        rng = random.Random(self.cfg.seed + 2)
        redis_at = self.load_started + self.cfg.load_seconds / 2
        database_at = self.load_started + self.cfg.load_seconds * 2 / 3
        while not self.chaos_stop.wait(self.cfg.kill_every * rng.uniform(0.6, 1.4)):
            if not self.redis_restarts and time.monotonic() >= redis_at:
                self.restart_redis()
                continue
            if not self.db_restarts and time.monotonic() >= database_at:
                self.restart_database()
                continue
            with self.lock:
                if self.chaos_stop.is_set():
                    return
                # A worker that is up and consuming (killing one still booting tests nothing).
                ready = [w for w in self.workers if w.ready()]
                if not ready:
                    continue
                victim = rng.choice(ready)
                victim.kill()
                self.kills += 1
                victim.start()

    def restart_redis(self) -> None:
        assert self.redis is not None
        # Kill it while it holds messages (at a light load the queue is mostly empty), within 10 s.
        deadline = time.monotonic() + 10
        length = self.queue_length()
        while time.monotonic() < deadline and not (length.isdigit() and int(length) > 0):
            time.sleep(0.05)
            length = self.queue_length()
        self.redis.kill()
        log(f"redis killed ({length} messages queued, lost with it)")
        time.sleep(1.0)
        self.start_redis()
        self.redis_restarted_at = time.monotonic()
        self.redis_restarts += 1
        log("redis restarted on the same port")

    def restart_database(self) -> None:
        """``pg_ctl restart`` of the engine's cluster once every worker is up (holding its kept
        connections; no kill happens meanwhile: this is the kill thread) and a step is in flight
        under a live lease, within 20 s."""
        assert self.pg is not None
        mode = DB_RESTART_MODES[self.cfg.seed % 2]
        in_flight: object = "?"
        try:
            with pg_connect(self.db_url) as conn:
                deadline = time.monotonic() + 20
                while True:
                    in_flight = conn.execute(  # in a live executor's hands: its lease holds
                        "SELECT count(*) FROM recovery_stepexecution s JOIN recovery_workflowrun r ON r.id = s.run_id "
                        "WHERE s.state = 'running' AND r.lease_expires_at > now()"
                    ).fetchone()[0]
                    up = all(w.ready() for w in self.workers)
                    if (in_flight and up) or time.monotonic() >= deadline or self.chaos_stop.is_set():
                        break
                    time.sleep(0.1)
        except Exception as exc:
            log(f"database: steps in flight not readable: {exc}")
        ready = sum(w.ready() for w in self.workers)
        log(
            f"database: pg_ctl restart -m {mode} of the engine's cluster "
            f"({in_flight} step(s) running, {ready}/{len(self.workers)} workers up)"
        )
        began = time.monotonic()
        with self.pg_lock:
            if self.pg_closed:
                return
            try:
                self.pg.restart(mode=mode)
            except Exception as exc:  # it would not stop or start: a violation, and try to bring it back
                self.chaos_failures.append(f"database restart (-m {mode}) failed: {str(exc).splitlines()[0]}")
                log(f"database restart failed: {exc}")
                if not self.pg.running:
                    try:
                        self.pg.start()
                    except Exception as again:
                        log(f"database: the engine's cluster does not start again: {again}")
                return
        self.db_restarts += 1
        log(f"database restarted (-m {mode}) in {time.monotonic() - began:.1f} s, same port")

    # --- the run ------------------------------------------------------------------------

    def run(self) -> list[str]:
        self.setup()
        plan = self.schedule()
        threads_per_path = {"celery": 3, "api": 2, "command": 2}
        producers = []
        self.load_started = time.monotonic()
        for path, items in plan.items():
            n = threads_per_path[path]
            for i in range(n):
                t = threading.Thread(target=self.producer, args=(path, items[i::n]), name=f"{path}-{i}", daemon=True)
                producers.append(t)
        chaos = [
            threading.Thread(target=self.chaos_faults, name="faults", daemon=True),
            threading.Thread(target=self.chaos_kills, name="kills", daemon=True),
        ]
        for t in producers + chaos:
            t.start()
        log(f"load: {self.cfg.runs} events × 2 over {self.cfg.load_seconds:.0f} s, with chaos")
        next_report = 0.0
        while any(t.is_alive() for t in producers) or time.monotonic() < self.load_started + self.cfg.load_seconds:
            if time.monotonic() >= next_report:
                self.report()
                next_report = time.monotonic() + 5
            time.sleep(0.5)
        self.chaos_stop.set()
        for t in chaos:
            t.join(120)
        if not self.redis_restarts:  # a very short load: still restart the broker once
            self.restart_redis()
        if not self.db_restarts and not self.chaos_failures:  # and the database
            self.restart_database()
        left = self.clear_faults()
        log(f"chaos stopped: {self.kills} kills, {self.faults} faults armed ({left} units never fired, cleared)")
        for w in self.workers:
            if not w.alive():
                w.start()
        quiet = self.wait_quiescence()
        self.report()
        self.stop_children()
        return self.check(quiet)

    def clear_faults(self) -> int:
        with pg_connect(self.sandbox_db_url) as conn:
            rows = conn.execute("SELECT mode, sum(remaining) FROM sandbox_fault GROUP BY mode").fetchall()
            conn.execute("DELETE FROM sandbox_fault")
        for mode, remaining in rows:
            self.fault_left[mode] += int(remaining or 0)
        return sum(self.fault_left.values())

    def release_auto_pauses(self, conn) -> bool:
        """What the on-call does once the incident is over (the faults cleared): release each step
        that paused itself while the ledger kept failing (``pause_after``), through the event API.
        Its runs then go on; a run still paused at the end is stuck. Whether anything was released."""
        rows = conn.execute(
            "SELECT workflow_name, step_name, reason FROM recovery_workflowpause "
            "WHERE released_at IS NULL AND automatic ORDER BY paused_at"
        ).fetchall()
        for workflow, step, reason in rows:
            request = urllib.request.Request(
                f"http://127.0.0.1:{self.server_port}/api/workflows/{workflow}/unpause",
                data=json.dumps({"step": step, "reason": "soak: the faults are cleared"}).encode(),
                headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
                method="POST",
            )
            try:
                with urllib.request.urlopen(request, timeout=15) as response:
                    released = json.loads(response.read()).get("released", [])
            except Exception as exc:  # the server restarting, the database down: the next poll
                log(f"unpausing {workflow} {step} failed: {exc}")
                return True
            self.auto_pauses.append(f"{workflow}.{step or '*'}")
            scope = step or "(all steps)"
            log(f"released {workflow} {scope}, paused by itself ({reason[:160]}): {len(released)} run(s)")
        return bool(rows)

    def approve_waiting(self, conn) -> bool:
        """What the approvers do: approve, in the tracker, the task of each invoice that waits for its
        approver's decision (invoice v3, above INVOICE_APPROVAL_WAIT_ABOVE); the tracker calls the run
        back, signed. A run still waiting 10 s later (its callback met the server restarting) is
        approved again: the same decision, the same event key, one event. Whether any was approved."""
        rows = conn.execute(
            "SELECT r.workflow_id, t.remote_ref FROM recovery_stepexecution w "
            "JOIN recovery_workflowrun r ON r.id = w.run_id "
            "JOIN recovery_stepexecution t ON t.run_id = w.run_id AND t.step_name = 'create_approval_task' "
            "WHERE w.step_name = 'approver_decision' AND w.state = 'waiting' AND t.remote_ref <> ''"
        ).fetchall()
        now, approved = time.monotonic(), False
        for run, task in rows:
            if now - self.approved.get(run, -1e9) < 10:
                continue
            request = urllib.request.Request(
                f"http://127.0.0.1:{self.server_port}/sandbox/tasks/{task}/decide",
                data=json.dumps({"decision": "approve", "by": "soak-approver"}).encode(),
                headers={"Authorization": f"Bearer {self.env['SANDBOX_API_KEY']}", "Content-Type": "application/json"},
                method="POST",
            )
            try:
                with urllib.request.urlopen(request, timeout=15) as response:
                    called = json.loads(response.read()).get("callback_status", "")
            except Exception as exc:  # the server restarting: the next poll
                log(f"approving {task} of {run} failed: {exc}")
                continue
            self.approved[run], approved = now, True
            log(f"approved {task} of {run} in the tracker: its callback answered {called or 'nothing'}")
        return approved

    def snapshot(self, conn) -> tuple[Counter, int, set[str]]:
        states = Counter(dict(conn.execute("SELECT state, count(*) FROM recovery_workflowrun GROUP BY state")))
        outbox = conn.execute("SELECT count(*) FROM recovery_outboxmessage WHERE state = 'pending'").fetchone()[0]
        ids = {row[0] for row in conn.execute("SELECT workflow_id FROM recovery_workflowrun")}
        return states, outbox, ids

    def report(self) -> None:
        try:
            with pg_connect(self.db_url) as conn:
                states, outbox, _ = self.snapshot(conn)
        except Exception as exc:
            log(f"progress: database not readable: {exc}")
            return
        shown = [f"{s}={states[s]}" for s in (*ACTIVE_STATES, "completed", *REVIEW_STATES) if states[s]]
        elapsed = time.monotonic() - self.started
        log(
            " ".join(
                [
                    f"{elapsed:5.0f}s runs={sum(states.values())}",
                    *shown,
                    f"outbox_pending={outbox} queue={self.queue_length()} kills={self.kills} faults={self.faults}",
                ]
            )
        )

    def wait_quiescence(self) -> bool:
        """Until every event has its run, no run is active and no outbox row is pending."""
        deadline = time.monotonic() + self.cfg.timeout
        quiet_polls, next_report = 0, time.monotonic() + 5
        conn = None
        redelivery_state: dict = {}
        try:
            while time.monotonic() < deadline:
                try:
                    conn = conn or pg_connect(self.db_url)
                    states, outbox, ids = self.snapshot(conn)
                    released = self.release_auto_pauses(conn)  # their runs are active again
                    released = self.approve_waiting(conn) or released
                except Exception as exc:
                    log(f"database not readable: {exc}")
                    conn = None
                    time.sleep(1)
                    continue
                missing = [k for k, e in enumerate(self.events) if workflow_id(e) not in ids]
                now = time.monotonic()
                # An event last delivered before the broker restarted was lost with it (had it
                # been consumed, its run would exist). Otherwise, like a queue's visibility
                # timeout with backoff, and only once the broker is nearly empty, so that a copy
                # still waiting in a backlog is not taken for lost.
                queue = self.queue_length()
                drained = queue.isdigit() and int(queue) < 50
                restarted = self.redis_restarted_at
                for k in missing:
                    last = self.last_delivery.get(k, 0.0)
                    wait = REDELIVER_AFTER * 2 ** self.redelivered.count(workflow_id(self.events[k]))
                    lost = restarted and last < restarted and now - restarted >= REDELIVER_AFTER
                    if (lost or drained) and now - last >= wait:
                        try:
                            self.send_celery(self.events[k], redelivery_state)
                        except Exception as exc:
                            log(f"redelivery of {workflow_id(self.events[k])} failed: {exc}")
                            drop_connection(redelivery_state)
                            continue
                        self.last_delivery[k] = now
                        self.redelivered.append(workflow_id(self.events[k]))
                        why = "delivered before the broker restart" if lost else "the broker is drained"
                        log(f"redelivered {workflow_id(self.events[k])}: no run, {why}")
                active = sum(states[s] for s in ACTIVE_STATES)
                if not missing and not active and not outbox and not released:
                    quiet_polls += 1
                    if quiet_polls >= 3:
                        log(f"quiescent after {time.monotonic() - self.started:.0f} s")
                        return True
                else:
                    quiet_polls = 0
                for w in [*self.workers, self.beat, self.server]:
                    if w is not None and not w.alive():
                        self.worker_deaths.append(f"{w.name} exited with {w.popen.returncode} on its own")
                        log(f"{w.name} died on its own (exit {w.popen.returncode}); restarted (see {w.log_path})")
                        w.start()
                if time.monotonic() >= next_report:
                    self.report()
                    next_report = time.monotonic() + 5
                time.sleep(1)
            log(f"no quiescence within SOAK_TIMEOUT={self.cfg.timeout:.0f} s")
            return False
        finally:
            if conn is not None:
                conn.close()
            drop_connection(redelivery_state)

    def stop_children(self) -> None:
        self.chaos_stop.set()
        with self.lock:
            transient = list(self.transient)
        for p in transient:
            if p.poll() is None:
                _killpg(p.pid, signal.SIGKILL)
        for child in [*self.workers, self.beat, self.server, self.redis]:
            if child is not None:
                child.stop()

    # --- the checks ---------------------------------------------------------------------

    def check(self, quiet: bool) -> list[str]:
        """Every invariant, read straight from both databases. Returns the violations."""
        v: list[str] = []
        with pg_connect(self.db_url) as db, pg_connect(self.sandbox_db_url) as sdb:
            now = db.execute("SELECT now()").fetchone()[0]
            runs = {
                r[0]: {
                    "id": r[0],
                    "wid": r[1],
                    "state": r[2],
                    "step": r[3],
                    "reason": r[4],
                    "lease": r[5],
                    "input": r[6],
                }
                for r in db.execute(
                    "SELECT id, workflow_id, state, current_step, status_reason, lease_expires_at, input "
                    "FROM recovery_workflowrun"
                )
            }
            steps: dict[int, dict[str, dict]] = defaultdict(dict)
            for run_id, name, state, ref, key, attempts, kind, error in db.execute(
                "SELECT run_id, step_name, state, remote_ref, idempotency_key, attempts, last_error_kind, last_error "
                "FROM recovery_stepexecution"
            ):
                steps[run_id][name] = {
                    "state": state,
                    "ref": ref,
                    "key": key,
                    "attempts": attempts,
                    "kind": kind,
                    "error": (error or "")[:160],
                }
            outbox = {
                (r[0], r[1]): {"key": r[2], "state": r[3], "ref": r[4], "attempts": r[5]}
                for r in db.execute(
                    "SELECT run_id, step_name, idempotency_key, state, provider_ref, attempts "
                    "FROM recovery_outboxmessage"
                )
            }
            audit = {
                r[0]: {"starts": r[1], "first": r[2], "last_run": r[3], "last_action": r[4]}
                for r in db.execute(
                    """
                    SELECT r.id,
                      (SELECT count(*) FROM recovery_auditevent a WHERE a.run_id = r.id AND a.action = 'start'),
                      (SELECT a.action FROM recovery_auditevent a WHERE a.run_id = r.id ORDER BY a.id LIMIT 1),
                      (SELECT a.after ->> 'run' FROM recovery_auditevent a
                        WHERE a.run_id = r.id AND a.after::jsonb ? 'run' ORDER BY a.id DESC LIMIT 1),
                      (SELECT a.action FROM recovery_auditevent a
                        WHERE a.run_id = r.id AND a.after::jsonb ? 'run' ORDER BY a.id DESC LIMIT 1)
                    FROM recovery_workflowrun r
                    """
                )
            }
            tasks = sdb.execute(
                "SELECT id, idempotency_key, payload ->> 'tenant', payload ->> 'invoice_id', status FROM sandbox_task"
            ).fetchall()
            messages = sdb.execute("SELECT id, client_ref, kind FROM sandbox_message").fetchall()
            entries = sdb.execute("SELECT id, reference, kind FROM sandbox_ledgerentry").fetchall()

        def describe(run: dict) -> str:
            parts = [
                f"{name}={s['state']}" + (f"({s['kind']})" if s["kind"] else "")
                for name, s in sorted(steps[run["id"]].items(), key=lambda item: STEPS.index(item[0]))
            ]
            return f"run {run['wid']} (pk {run['id']}) state={run['state']} [{' '.join(parts)}]"

        # 1. One run per event (each was delivered at least twice).
        by_wid = {run["wid"]: run for run in runs.values()}
        expected = {workflow_id(e): e for e in self.events}
        if len(runs) != self.cfg.runs:
            v.append(f"run count: {len(runs)} runs for {self.cfg.runs} events")
        for wid in sorted(set(expected) - set(by_wid)):
            v.append(f"missing run: no run for event {wid}")
        for wid in sorted(set(by_wid) - set(expected)):
            v.append(f"unexpected run: {wid} matches no event")
        for wid, run in by_wid.items():
            if wid in expected and run["input"] != expected[wid]:
                v.append(f"run {wid}: input differs from its event: {run['input']!r}")

        # 2. No duplicate side effect.
        duplicates = 0
        groups = [
            ("task", "invoice", Counter((t[2], t[3]) for t in tasks), lambda g: f"{g[0]}/{g[1]}"),
            ("task", "idempotency key", Counter(t[1] for t in tasks), str),
            ("message", "client_ref", Counter(m[1] for m in messages if m[2] == "message"), str),
            ("ledger entry", "reference", Counter(e[1] for e in entries if e[2] == "entry"), str),
        ]
        for what, by, counts, show in groups:
            for group, count in counts.items():
                if count > 1:
                    duplicates += count - 1
                    v.append(f"duplicate: {count} {what}s with one {by} {show(group)}")

        # 3. Every run completed or in an explicit review state; 4. nothing running past its lease.
        stuck = [run for run in runs.values() if run["state"] not in ("completed", *REVIEW_STATES)]
        for run in stuck:
            v.append(f"stuck: {describe(run)} reason={run['reason'][:160]!r}")
        for run in runs.values():
            expired = run["lease"] is None or run["lease"] < now
            if run["state"] == "running" and expired:
                v.append(f"lease: {describe(run)} is running past its lease ({run['lease']})")
            for name, s in steps[run["id"]].items():
                if s["state"] == "running" and expired:
                    v.append(
                        f"lease: {describe(run)}: step {name} is running, the run's lease expired ({run['lease']})"
                    )

        # 5. Completed runs: every step done, three remote references, one object of each kind.
        task_by_key = defaultdict(list)
        for t in tasks:
            task_by_key[t[1]].append(f"task_{t[0]}")
        msg_by_ref = defaultdict(list)
        for m in messages:
            if m[2] == "message":
                msg_by_ref[m[1]].append(f"msg_{m[0]}")
        entry_by_ref = defaultdict(list)
        for e in entries:
            if e[2] == "entry":
                entry_by_ref[e[1]].append(f"le_{e[0]}")

        def remote_objects(run: dict) -> dict[str, list[str]]:
            st = steps[run["id"]]
            return {
                "create_approval_task": task_by_key.get(st.get("create_approval_task", {}).get("key"), []),
                "notify_approver": msg_by_ref.get(st.get("notify_approver", {}).get("key"), []),
                "post_ledger_entry": entry_by_ref.get(run["wid"], []),
            }

        for run in runs.values():
            st = steps[run["id"]]
            if set(st) != set(STEPS):
                v.append(f"steps: {describe(run)} has steps {sorted(st)}")
            if run["state"] != "completed":
                continue
            objects = remote_objects(run)
            for name in STEPS:
                if st.get(name, {}).get("state") != "succeeded":
                    v.append(f"completed: {describe(run)}: step {name} is not succeeded")
            for name in EFFECT_STEPS:
                ref = st.get(name, {}).get("ref", "")
                found = objects[name]
                if not ref:
                    v.append(f"completed: {describe(run)}: {name} has no remote reference")
                if len(found) != 1:
                    v.append(f"completed: {describe(run)}: {name} has {len(found)} objects in the sandbox {found}")
                elif ref and ref != found[0]:
                    v.append(f"completed: {describe(run)}: {name} remote_ref {ref} but the sandbox holds {found[0]}")
            box = outbox.get((run["id"], "notify_approver"))
            if box is None or box["state"] != "delivered":
                v.append(f"completed: {describe(run)}: outbox message is {box and box['state']}")

        # Every effect in the sandbox is known to its run (a step that says "did not happen"
        # while the receiver holds the object is a lie: rule 7), and every succeeded effect
        # step kept its remote reference.
        run_by_key = {s["key"]: (run_id, name) for run_id, st in steps.items() for name, s in st.items()}
        for kind, objects, locate in (
            ("task", task_by_key, lambda key: run_by_key.get(key)),
            ("message", msg_by_ref, lambda key: run_by_key.get(key)),
            (
                "ledger entry",
                entry_by_ref,
                lambda ref: (by_wid[ref]["id"], "post_ledger_entry") if ref in by_wid else None,
            ),
        ):
            for key, ids in objects.items():
                owner = locate(key)
                if owner is None:
                    v.append(f"orphan {kind}: {ids} ({key}) belongs to no run's step")
                    continue
                run, s = runs[owner[0]], steps[owner[0]][owner[1]]
                if s["state"] not in EFFECT_MAY_EXIST:
                    v.append(f"unrecorded {kind}: {ids} exists but {describe(run)} says {owner[1]}={s['state']}")
                box = outbox.get(owner)
                if kind == "message" and box is not None and box["state"] in ("failed", "cancelled", "pending"):
                    v.append(
                        f"unrecorded message: {ids} exists but the outbox row of {describe(run)} is "
                        f"{box['state']} after {box['attempts']} attempt(s)"
                    )
        for run in runs.values():
            for name in EFFECT_STEPS:
                s = steps[run["id"]].get(name)
                if s and s["state"] == "succeeded" and not s["ref"]:
                    v.append(f"reference: {describe(run)}: {name} succeeded without a remote reference")

        # 6. The audit trail agrees with the run.
        for run in runs.values():
            a = audit.get(run["id"])
            if a is None or a["starts"] != 1:
                v.append(f"audit: {describe(run)} has {a and a['starts']} start events")
            if a is not None and a["first"] != "start":
                v.append(f"audit: {describe(run)}: first event is {a['first']!r}, not 'start'")
            if a is not None and a["last_run"] != run["state"]:
                v.append(f"audit: {describe(run)}: last run event {a['last_action']!r} says run={a['last_run']!r}")

        self.stats = {
            "completed": sum(run["state"] == "completed" for run in runs.values()),
            "review": sum(run["state"] in REVIEW_STATES for run in runs.values()),
            "duplicates": duplicates,
            "stuck": len(stuck),
            "runs": len(runs),
        }
        # Not a violation by the rules above (needs_review is explicit), but the engine says an
        # "executor error" is a bug in a workflow or in the engine: shown, and counted in the summary.
        self.executor_errors = [
            f"{describe(run)} reason={run['reason'][:200]!r}"
            for run in runs.values()
            if run["reason"].startswith("executor error")
        ]
        self.review_breakdown = Counter(
            (run["state"], _reason_kind(run["reason"])) for run in runs.values() if run["state"] in REVIEW_STATES
        )
        self.sandbox_counts = {
            "tasks": len(tasks),
            "messages": sum(m[2] == "message" for m in messages),
            "ledger_entries": sum(e[2] == "entry" for e in entries),
        }
        v.extend(self.chaos_failures)
        if not quiet:
            v.append(f"quiescence: not reached within SOAK_TIMEOUT={self.cfg.timeout:.0f} s")
        return v

    def info(self) -> None:
        """What happened, for the reader (stderr)."""
        log(
            "deliveries: "
            + ", ".join(f"{path}={n}" for path, n in sorted(self.delivered.items()))
            + (f"; retried sends: {dict(self.delivery_retries)}" if self.delivery_retries else "")
        )
        if self.redelivered:
            events = sorted(set(self.redelivered))
            log(
                f"{len(events)} event(s) had no run long after their last delivery (start_run lost with the broker "
                f"restart or a killed worker's prefetch) and were redelivered ({len(self.redelivered)} redeliveries): "
                + ", ".join(events[:20])
                + (" …" if len(events) > 20 else "")
            )
        fired = {m: self.fault_units[m] - self.fault_left[m] for m in sorted(self.fault_units)}
        log(
            f"faults: {self.faults} armed, units fired by mode {fired}; redis restarts: {self.redis_restarts}; "
            f"database restarts: {self.db_restarts} (-m {DB_RESTART_MODES[self.cfg.seed % 2]})"
        )
        if self.auto_pauses:
            log(f"steps that paused themselves and were released after the chaos: {', '.join(self.auto_pauses)}")
        for death in self.worker_deaths:
            log(f"unexpected: {death}")
        for line in self.executor_errors:
            log(f"EXECUTOR ERROR (review, not a violation): {line}")
        stats = getattr(self, "stats", None)
        if stats is not None:
            log(f"sandbox: {self.sandbox_counts}")
            for (state, reason), n in sorted(self.review_breakdown.items()):
                log(f"review: {n} × {state}: {reason}")


def drop_connection(state: dict) -> None:
    conn = state.pop("conn", None)
    if conn is not None:
        try:
            conn.release()
        except Exception:
            pass


def _reason_kind(reason: str) -> str:
    """A run's status reason without its ids and numbers, to group them."""
    words = []
    for word in (reason or "").split()[:14]:
        words.append("#" if any(c.isdigit() for c in word) else word)
    return " ".join(words)


def main() -> int:
    started = time.monotonic()

    def terminate(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, terminate)
    try:
        cfg = Config.from_env()
        soak = Soak(cfg)
    except SetupError as exc:
        print(exc, file=sys.stderr, flush=True)
        return 2
    violations: list[str] = []
    status = 1
    try:
        try:
            violations = soak.run()
            status = 1 if violations else 0
        except SetupError as exc:
            print(exc, file=sys.stderr, flush=True)
            status = 2
        except KeyboardInterrupt as exc:
            log(f"interrupted ({exc}): stopping")
            status = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # let the clean-up finish
            signal.signal(sig, signal.SIG_IGN)
        soak.stop_children()
        soak.stop_cluster()
        if cfg.keep:
            log(f"database kept: {redact(soak.sandbox_db_url)}")
        else:
            soak.drop_databases()
        if (cfg.keep or status != 0) and any(soak.tmp.iterdir()):
            log(f"logs kept in {soak.tmp}")
        else:
            shutil.rmtree(soak.tmp, ignore_errors=True)
    if status == 2 or soak.stats is None:
        return status
    soak.info()
    for line in violations:
        print(f"VIOLATION {line}", flush=True)
    s = soak.stats
    elapsed = time.monotonic() - started
    print(
        f"soak: runs={s['runs']} completed={s['completed']} review={s['review']} kills={soak.kills} "
        f"faults={soak.faults} db_restarts={soak.db_restarts} duplicates={s['duplicates']} stuck={s['stuck']} "
        f"redelivered={len(set(soak.redelivered))} executor_errors={len(soak.executor_errors)} "
        f"violations={len(violations)} elapsed={elapsed:.0f}s",
        flush=True,
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
