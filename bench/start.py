"""Starting runs: ``run_start`` one event at a time against ``run_start_many`` in batches, from one
process, and the event API over HTTP (``POST /api/events/bench``, JSON arrays of ``--batch``
events, token authentication) served by gunicorn; on the same PostgreSQL, alternating, in the same
run (figures as a ratio).

    .venv/bin/python bench/start.py                  # 1,000 events per measurement, 3 rounds
    .venv/bin/python bench/start.py --events 2000 --batch 100 --rounds 5

Each measurement starts its own fresh events (new workflow ids) of the bench workflow
(``bench/executor_workflow.py``: three steps) into a throw-away database on the server of
``--database-url`` (default DATABASE_URL, else postgres://postgres@127.0.0.1:5432/postgres),
dropped at the end. Prints runs/s per measurement, the medians and their ratio, and one JSON line.

The API measurement (``measure_api``, importable: ``from bench.start import measure_api``) starts
its own ``gunicorn config.wsgi`` (``--api-workers`` sync workers, as ``bench/server.py`` serves
the console) on a free port of 127.0.0.1, in its own process group, ready once ``/healthz``
answers with every worker up, and stops it at the end, also on failure. Production settings from
the same environment as the other measurements (``DJANGO_DEBUG=0``; ``DATABASE_CONN_MAX_AGE`` as
that environment says, here the default 0 of docs/operating.md), plus ``PROMETHEUS_MULTIPROC_DIR``
(a fresh directory, as production runs gunicorn) and ``DJANGO_SECURE_SSL_REDIRECT=0``: plain HTTP
on the loopback, as the other benchmarks do (docs/security.md). The token is issued by
``manage.py create_api_token NAME --workflow bench`` (docs/operating.md "Event API") and sent as
``Authorization: Bearer``. Every request is a JSON array of ``--batch`` events, answered 207;
every item must say 201 and created for the event at its index, and the database must then hold
exactly the runs sent, or the bench fails (ApiBenchError). Two small untimed batches per worker
warm the workers up first (imports, URL resolver); they are counted in the check.

The client: ``--api-clients`` threads of this process (default 3), each posting the next
pre-encoded batch over its own ``http.client`` connection (gunicorn's sync workers close it after
each answer; http.client reconnects), the answers checked after the clock stops. Measured on this
two-core machine (2 workers, 3,000 events in batches of 100, medians of 5, PostgreSQL on the same
machine): 1 client 1,411 events/s (the machine 80–85 % busy: a worker waits for each round trip),
2 clients 2,194, 3 clients 2,314, 4 clients 2,157; from 2 clients on, the machine is 95–98 % busy
(gunicorn's two workers about 45 % of a core each, PostgreSQL most of the rest), so more clients
only queue. This client uses about 1 % of a core (printed per round with those figures): it is not
the bottleneck.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the ``bench`` namespace package, also when run as bench/start.py
from bench.server import free_port, gunicorn_argv  # noqa: E402

PY = sys.executable
MANAGE = str(ROOT / "manage.py")
READY_TIMEOUT = 120.0  # seconds gunicorn has to answer /healthz with all its workers
API_CLIENTS = 3  # concurrent connections that keep two sync workers busy (see the docstring)

# Runs in the child (Django set up there): one measurement, its runs/s on stdout.
MEASURE = """
import os, sys, time
import django
django.setup()
from recovery.engine.transitions import run_start, run_start_many
kind, prefix, events, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
data = [{"id": f"{prefix}-{i}"} for i in range(events)]
began = time.perf_counter()
if kind == "one":
    for event in data:
        run_start(workflow="bench", data=event)
else:
    for i in range(0, events, batch):
        results = run_start_many(workflow="bench", events=data[i : i + batch])
        assert all(r.outcome == "created" for r in results), results
print(events / (time.perf_counter() - began))
"""


class ApiBenchError(RuntimeError):
    """The API measurement could not be made or its answers were wrong."""


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes so far (from /proc/PID/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / tick


def _machine_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine so far (the first line of /proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return sum(values) - idle, sum(values)


def _get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path, headers={"Host": f"127.0.0.1:{port}"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


class Gunicorn:
    """``gunicorn config.wsgi`` on a free port of 127.0.0.1, in its own process group."""

    def __init__(self, env: dict[str, str], workers: int, log_path: Path) -> None:
        self.env, self.workers, self.log_path = env, workers, log_path
        self.port = 0
        self.process: subprocess.Popen | None = None

    def start(self) -> Gunicorn:
        self.port = free_port()
        argv = gunicorn_argv(self.port, self.workers)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ApiBenchError(f"gunicorn exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                if _get(self.port, "/healthz") == 200 and len(self.worker_pids()) == self.workers:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise ApiBenchError(f"gunicorn did not answer /healthz within {READY_TIMEOUT:.0f} s:\n{self.log_tail()}")

    def worker_pids(self) -> list[int]:
        return _children(self.process.pid) if self.process is not None else []

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text()[-chars:]
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            self.process.wait()


def server_env(env: dict[str, str], metrics_dir: Path) -> dict[str, str]:
    """``env`` (a Django environment) as gunicorn gets it here."""
    return {
        **env,
        "DJANGO_SECURE_SSL_REDIRECT": "0",  # plain HTTP on the loopback: no TLS to redirect to
        "DJANGO_ALLOWED_HOSTS": env.get("DJANGO_ALLOWED_HOSTS") or "127.0.0.1,localhost",
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),  # as production runs gunicorn (docs/operating.md)
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    }


def issue_token(env: dict[str, str], name: str, workflow: str = "bench") -> str:
    """``manage.py create_api_token NAME --workflow WORKFLOW``: the token it prints once."""
    done = subprocess.run(
        [PY, MANAGE, "create_api_token", name, "--workflow", workflow],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith("rc_"):
        raise ApiBenchError(f"create_api_token failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return lines[-1]


def post_batches(port: int, token: str, bodies: list[bytes], clients: int) -> list[tuple[int, bytes]]:
    """POST every body to ``/api/events/bench`` from ``clients`` threads, each over its own
    connection; the (status, body) of each answer, in the order of ``bodies``."""
    answers: list[tuple[int, bytes] | None] = [None] * len(bodies)
    errors: list[BaseException] = []
    lock = threading.Lock()
    next_index = iter(range(len(bodies)))
    headers = {
        "Host": f"127.0.0.1:{port}",
        "Authorization": f"Bearer {token}",
        "Content-Type": "application/json",
        "Accept": "application/json",
    }

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            while True:
                with lock:
                    i = next(next_index, None)
                if i is None or errors:
                    return
                conn.request("POST", "/api/events/bench", body=bodies[i], headers=headers)
                response = conn.getresponse()
                answers[i] = (response.status, response.read())
        except BaseException as exc:  # reported by the caller, with the others
            errors.append(exc)
        finally:
            conn.close()

    threads = [threading.Thread(target=client, name=f"api-client-{n}") for n in range(max(1, clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise ApiBenchError(f"a request failed: {type(errors[0]).__name__}: {errors[0]}") from errors[0]
    return [answer for answer in answers if answer is not None]


def check_answers(batches: list[list[dict]], answers: list[tuple[int, bytes]]) -> None:
    """Every answer 207, every item of it 201 and created, for the event sent at its index."""
    if len(answers) != len(batches):
        raise ApiBenchError(f"{len(answers)} answers to {len(batches)} requests")
    for events, (status, body) in zip(batches, answers, strict=True):
        if status != 207:
            raise ApiBenchError(f"HTTP {status} (expected 207): {body[:500]!r}")
        results = json.loads(body)["results"]
        if len(results) != len(events):
            raise ApiBenchError(f"{len(results)} results for {len(events)} events: {body[:500]!r}")
        for index, (event, item) in enumerate(zip(events, results, strict=True)):
            expected = {"index": index, "status": 201, "workflow_id": f"bench:{event['id']}", "created": True}
            if {key: item.get(key) for key in expected} != expected:
                raise ApiBenchError(f"event {event['id']} not created: {item}")


def count_runs(database_url: str, workflow_ids: list[str], like: str) -> tuple[int, int]:
    """(runs among ``workflow_ids``, runs whose workflow id is LIKE ``like``)."""
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE workflow_id = ANY(%s)), count(*) FILTER (WHERE workflow_id LIKE %s)"
            " FROM recovery_workflowrun",
            [workflow_ids, like],
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def measure_api(
    env: dict[str, str],
    events: int,
    batch: int,
    prefix: str,
    api_workers: int = 2,
    clients: int = API_CLIENTS,
    report: bool = True,
) -> float:
    """Events/s through ``POST /api/events/bench`` in JSON arrays of ``batch`` events, from
    ``clients`` concurrent connections, to a gunicorn of ``api_workers`` sync workers started
    (and stopped) here on ``env`` (a Django environment whose DATABASE_URL is migrated and whose
    RECOVERY_WORKFLOW_MODULES include ``bench.executor_workflow``). ``prefix`` makes the events'
    ids (``bench:{prefix}-{i}``) and the token's name unique: use a fresh one per call. Raises
    ApiBenchError if an event is not created or the database does not hold exactly the runs sent."""
    if not 1 <= batch <= 1000:
        raise ValueError("the event API takes batches of 1 to 1000 events")
    if any(not c.isalnum() and c not in "-_." for c in prefix):
        raise ValueError(f"prefix {prefix!r}: letters, digits, '-', '_' and '.' only")
    token = issue_token(env, f"bench-{prefix}")
    timed = [{"id": f"{prefix}-{i}"} for i in range(events)]
    batches = [timed[i : i + batch] for i in range(0, events, batch)]
    # Untimed: two small batches per worker, so that each has imported and resolved what it needs.
    warm = [[{"id": f"{prefix}-warm{w}-{i}"} for i in range(min(batch, 10))] for w in range(2 * api_workers)]
    expected_ids = [f"bench:{e['id']}" for b in (*warm, *batches) for e in b]

    with tempfile.TemporaryDirectory(prefix=f"bench-api-{prefix}-") as tmp:
        metrics_dir = Path(tmp) / "prometheus"
        metrics_dir.mkdir()
        server = Gunicorn(server_env(env, metrics_dir), api_workers, Path(tmp) / "gunicorn.log")
        try:
            server.start()
            bodies = [json.dumps(b, separators=(",", ":")).encode() for b in batches]
            check_answers(warm, post_batches(server.port, token, [json.dumps(b).encode() for b in warm], clients))
            workers = server.worker_pids()
            cpu_workers, cpu_client = _cpu_seconds(workers), resource.getrusage(resource.RUSAGE_SELF)
            machine = _machine_cpu()
            began = time.perf_counter()
            answers = post_batches(server.port, token, bodies, clients)
            elapsed = time.perf_counter() - began
            busy, total = (after - before for after, before in zip(_machine_cpu(), machine, strict=True))
            cpu_workers = _cpu_seconds(workers) - cpu_workers
            after = resource.getrusage(resource.RUSAGE_SELF)
            cpu_client = (after.ru_utime - cpu_client.ru_utime) + (after.ru_stime - cpu_client.ru_stime)
            check_answers(batches, answers)
        except BaseException:
            print(f"gunicorn's log (last lines):\n{server.log_tail()}", file=sys.stderr)
            raise
        finally:
            server.stop()

    found, like = count_runs(env["DATABASE_URL"], expected_ids, f"bench:{prefix}-%")
    if found != len(expected_ids) or like != len(expected_ids):
        raise ApiBenchError(
            f"the database holds {found} of the {len(expected_ids)} runs sent ({like} with the prefix {prefix!r})"
        )
    rate = events / elapsed
    if report:
        print(
            f"  api: {len(batches)} requests in {elapsed:.2f} s from {clients} clients; CPU: gunicorn workers"
            f" {cpu_workers / elapsed / len(workers):.0%} of a core each, this client {cpu_client / elapsed:.0%},"
            f" the machine {busy / max(total, 1):.0%} busy",
            file=sys.stderr,
        )
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--api-workers", type=int, default=2, help="gunicorn sync workers for the API (2)")
    parser.add_argument(
        "--api-clients", type=int, default=API_CLIENTS, help=f"concurrent HTTP connections ({API_CLIENTS})"
    )
    parser.add_argument(
        "--database-url", default=os.environ.get("DATABASE_URL") or "postgres://postgres@127.0.0.1:5432/postgres"
    )
    args = parser.parse_args()
    parts = urlsplit(args.database_url)
    admin_url = urlunsplit(parts._replace(path="/postgres"))
    name = f"bench_start_{os.getpid()}"
    url = urlunsplit(parts._replace(path=f"/{name}"))
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "DJANGO_DEBUG": "0",
        "DJANGO_SECRET_KEY": "bench-start",
        "DATABASE_URL": url,
        "SANDBOX_DATABASE_URL": f"sqlite:////tmp/{name}-sandbox.sqlite3",
        "RECOVERY_WORKFLOW_MODULES": "workflows.registry,bench.executor_workflow",
        "PYTHONPATH": str(ROOT),
    }
    kinds = ("one", "many", "api")
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            subprocess.run([PY, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)
            rates: dict[str, list[float]] = {kind: [] for kind in kinds}
            for round_ in range(args.rounds):
                for kind in kinds if round_ % 2 == 0 else kinds[::-1]:
                    if kind == "api":
                        rate = measure_api(
                            env, args.events, args.batch, f"api{round_}", args.api_workers, args.api_clients
                        )
                        rates[kind].append(rate)
                        print(f"round {round_}: {kind:4} {rate:8.1f} events/s", file=sys.stderr)
                        continue
                    argv = [PY, "-c", MEASURE, kind, f"{kind}{round_}", str(args.events), str(args.batch)]
                    out = subprocess.run(argv, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
                    rates[kind].append(float(out.stdout.strip().splitlines()[-1]))
                    print(f"round {round_}: {kind:4} {rates[kind][-1]:8.1f} runs/s", file=sys.stderr)
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            Path(f"/tmp/{name}-sandbox.sqlite3").unlink(missing_ok=True)
    one, many, api = (statistics.median(rates[kind]) for kind in kinds)
    print(f"run_start, one event at a time: {one:.0f} runs/s (median of {args.rounds})")
    print(f"run_start_many, batches of {args.batch}: {many:.0f} runs/s; ratio {many / one:.2f}")
    print(
        f"event API over HTTP (gunicorn, {args.api_workers} sync workers, {args.api_clients} clients, token auth),"
        f" batches of {args.batch}: {api:.0f} events/s (median of {args.rounds}); {api / many:.2f} of run_start_many"
    )
    print(
        json.dumps(
            {
                "start_runs_per_s": round(one, 1),
                "start_many_runs_per_s": round(many, 1),
                "ratio": round(many / one, 2),
                "api_events_per_s": round(api, 1),
                "api_workers": args.api_workers,
                "api_clients": args.api_clients,
                "batch": args.batch,
                "events": args.events,
                "load_average": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
