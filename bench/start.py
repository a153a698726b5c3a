"""Starting runs: ``run_start`` one event at a time against ``run_start_many`` in batches, from one
process, on the same PostgreSQL, alternating, in the same run (figures as a ratio).

    .venv/bin/python bench/start.py                  # 1,000 events per measurement, 3 rounds
    .venv/bin/python bench/start.py --events 2000 --batch 100 --rounds 5

Each measurement starts its own fresh events (new workflow ids) of the bench workflow
(``bench/executor_workflow.py``: three steps) into a throw-away database on the server of
``--database-url`` (default DATABASE_URL, else postgres://postgres@127.0.0.1:5432/postgres),
dropped at the end. Prints runs/s per measurement, the medians and their ratio, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
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
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            subprocess.run([PY, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)
            rates: dict[str, list[float]] = {"one": [], "many": []}
            for round_ in range(args.rounds):
                for kind in ("one", "many") if round_ % 2 == 0 else ("many", "one"):
                    argv = [PY, "-c", MEASURE, kind, f"{kind}{round_}", str(args.events), str(args.batch)]
                    out = subprocess.run(argv, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
                    rates[kind].append(float(out.stdout.strip().splitlines()[-1]))
                    print(f"round {round_}: {kind:4} {rates[kind][-1]:8.1f} runs/s", file=sys.stderr)
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    one, many = statistics.median(rates["one"]), statistics.median(rates["many"])
    print(f"run_start, one event at a time: {one:.0f} runs/s (median of {args.rounds})")
    print(f"run_start_many, batches of {args.batch}: {many:.0f} runs/s; ratio {many / one:.2f}")
    print(
        json.dumps(
            {
                "start_runs_per_s": round(one, 1),
                "start_many_runs_per_s": round(many, 1),
                "ratio": round(many / one, 2),
                "batch": args.batch,
                "events": args.events,
                "load_average": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
