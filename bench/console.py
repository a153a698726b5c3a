"""Benchmark the operator console's pages on a production-sized database, through a real server.

    .venv/bin/python bench/console.py                       # 20,000 runs: a few minutes
    .venv/bin/python bench/console.py --runs 1000000 --reuse bench_console_1m
                                                            # 1M runs, 5M steps, 10M audit events;
                                                            # seeds once (~5 min), then reuses

It seeds a throw-away database on the PostgreSQL server of ``--database-url`` with
``bench/seed.py`` (COPY; see there for the data), creates a supervisor with ``manage.py
createoperator``, starts gunicorn on 127.0.0.1 serving ``config.wsgi`` with production settings
(``DJANGO_DEBUG=0``; ``DATABASE_CONN_MAX_AGE`` from ``--conn-max-age``, default 0 as in
production's default) plus ``bench/querycount.py``'s server-side query counter, logs in through
``/login/`` and requests each page ``--requests`` times, one at a time, after one logged warm-up:

- the runs list: the first page, and page ``--deep-page`` (500) reached through its keyset
  ``rel="next"`` links; and its counts part (the chips' numbers, an htmx request of its own);
- every stuck filter the runs page offers (read from the page), ``stuck=any``, and a state filter;
- search (``q``) by a full workflow id, a workflow id prefix, an idempotency key and a remote
  reference (all of an old run, the worst case for a newest-first list), and the business-key
  prefix filter (``key``);
- the run page of the run with 1,000 audit events, and of an ordinary run; its live poll, when
  the run has changed and when nothing has;
- the dashboard;
- ``/metrics``, as a Prometheus scraper reads it (its token; gauges counted on every scrape).

It prints, per page, p50 / p95 of the client-side time (the whole response), the SQL queries per
request (counted server-side), their total time and the slowest query; then ``EXPLAIN (ANALYZE,
BUFFERS)`` of the slowest query of each page that misses its target (``--explain all``: of every
page); then the table; and last one line of JSON with the figures and whether the targets hold:
p95 < 100 ms for the list, the filters, search and the run page; at most ``--max-queries``
queries per page and the same number whatever the rows shown (list pages of 50 rows and of 1,
but for the two reads a page with no unfinished run skips; the run with 1,000 events and a run
in the same state with ten: no N+1); no full count: every
``COUNT(`` without a ``LIMIT`` (the console caps its counts at ``counts.COUNT_CAP``) is run
under ``EXPLAIN ANALYZE`` and fails if its scans read more than COUNT_CAP rows. Queries repeated
word for word within a request are counted too. The load average before and after is in the JSON:
another CPU-heavy process on this two-core machine makes every figure noisy.

The throw-away database is dropped at the end unless ``--keep``; ``--reuse NAME`` keeps (and on
the first use, seeds) the database NAME, so a 1M-run seed is paid once. The server stops at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlencode

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg  # noqa: E402

from bench import seed  # noqa: E402
from bench.server import Server, Session, create_supervisor, next_link  # noqa: E402

TARGET_MS = 100.0
METRICS_TOKEN = "bench-console-metrics-token"  # the server's RECOVERY_METRICS_TOKEN
COUNT_CAP = 10_000  # recovery.counts.COUNT_CAP
TARGET_GROUPS = ("list", "filter", "search", "detail")
OPTIONAL_READS = 2  # a list page with no unfinished run reads neither their steps nor their requests
FULL_COUNT = re.compile(r"\bCOUNT\(", re.IGNORECASE)
DETAIL_BIG = "run: 1,000 audit events"
DETAIL_SAME_STATE = "run: same state, 10 events"


@dataclass(frozen=True)
class Page:
    name: str
    path: str
    group: str  # list, filter, search, detail, dashboard or metrics
    headers: tuple[tuple[str, str], ...] = ()  # e.g. the htmx poll's
    status: int = 200  # what the page answers when it works


@dataclass
class Measurement:
    page: Page
    ms: list[float] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)
    queries: list[int] = field(default_factory=list)
    db_ms: list[float] = field(default_factory=list)
    sql: list[dict] = field(default_factory=list)  # the warm-up request's queries
    uncapped: list[dict] = field(default_factory=list)  # its COUNT( without LIMIT: sql, ms, rows_read
    bytes: int = 0

    @property
    def p50(self) -> float:
        return percentile(self.ms, 50)

    @property
    def p95(self) -> float:
        return percentile(self.ms, 95)

    @property
    def max_queries(self) -> int:
        return max(self.queries)

    @property
    def full_counts(self) -> list[dict]:
        """Uncapped counts that read more than COUNT_CAP rows."""
        return [u for u in self.uncapped if u["rows_read"] > COUNT_CAP]

    @property
    def duplicates(self) -> int:
        """Queries that repeat an earlier query of the same request word for word."""
        texts = [q["sql"] for q in self.sql]
        return len(texts) - len(set(texts))

    @property
    def slowest(self) -> dict:
        return max(self.sql, key=lambda q: q["ms"]) if self.sql else {"sql": "", "ms": 0.0}

    @property
    def meets_target(self) -> bool:
        return self.page.group not in TARGET_GROUPS or self.p95 < TARGET_MS


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def q(**params: str) -> str:
    return "/?" + urlencode(params)


def same_state_run(db_url: str, info: dict) -> str:
    """A run in the detail run's state and cause (needs review, unknown outcome) with few events."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            """SELECT workflow_id FROM recovery_workflowrun
               WHERE state = 'needs_review' AND status_reason LIKE %s AND workflow_id <> %s ORDER BY id LIMIT 1""",
            ("%outcome unknown and look-up failed", info["detail_workflow_id"]),
        ).fetchone()
    if row is None:
        raise SystemExit("no needs-review run with an unknown outcome in the seed")
    return str(row[0])


def pages(session: Session, db_url: str, info: dict, deep: tuple[int, str]) -> list[Page]:
    first = session.get("/")
    causes = list(dict.fromkeys(re.findall(r'href="\?stuck=([a-z_]+)"', first.body.decode())))
    wid = info["search_workflow_id"]
    out = [
        Page("runs: first page", "/", "list"),
        Page(f"runs: page {deep[0]} (keyset)", deep[1], "list"),
        # The chips' numbers, which a list page fetches apart as soon as it has loaded.
        Page("runs: counts (htmx)", "/?state=", "list", (("HX-Request", "true"), ("HX-Target", "counts"))),
        *[Page(f"stuck={cause}", q(stuck=cause), "filter") for cause in causes],
        Page("state=failed", q(state="failed"), "filter"),
        Page("q=workflow id", q(q=wid), "search"),
        Page("q=workflow id prefix", q(q=wid[:-3]), "search"),
        Page("q=idempotency key", q(q=info["search_idempotency_key"]), "search"),
        Page("q=remote ref", q(q=info["search_remote_ref"]), "search"),
        Page("key=business key prefix", q(key=info["search_business_key"]), "search"),
        Page(DETAIL_BIG, "/runs/" + info["detail_workflow_id"], "detail"),
        Page(DETAIL_SAME_STATE, "/runs/" + same_state_run(db_url, info), "detail"),
        Page("run: completed, 10 events", "/runs/" + info["normal_workflow_id"], "detail"),
        *live_polls(session, "/runs/" + info["detail_workflow_id"]),
        Page("dashboard", "/dashboard", "dashboard"),
        Page("metrics (a scrape)", "/metrics", "metrics", (("Authorization", f"Bearer {METRICS_TOKEN}"),)),
    ]
    return out


def deep_page(session: Session, n: int) -> tuple[int, str]:
    """Follow the runs list's ``rel="next"`` links from the first page to page ``n`` (or the last)."""
    path, page = "/", 1
    started = time.perf_counter()
    while page < n:
        response = session.get(path)
        following = next_link(response.body)
        if following is None:
            break
        path, page = following, page + 1
    seed.log(f"reached page {page} ({path}) through next links in {time.perf_counter() - started:.1f}s")
    return page, path


def live_polls(session: Session, path: str) -> list[Page]:
    """The run page's 3 s poll (htmx): when the run has changed since the page last showed it
    (its live parts, out of band), and when nothing shown has (204, nothing to swap)."""
    seen = re.search(r"seen=(\w+)", session.get(path).body.decode())
    if seen is None:
        raise SystemExit(f"GET {path}: the page has no live poll")
    poll = (("HX-Request", "true"), ("HX-Target", "run-poll"))
    return [
        Page("run: live poll, changed", f"{path}?live=1&shown=x", "detail", poll),
        Page("run: live poll, unchanged", f"{path}?live=1&shown=x&seen={seen.group(1)}", "detail", poll, 204),
    ]


def measure(session: Session, page: Page, requests: int) -> Measurement:
    result = Measurement(page)
    warm = session.get(page.path, headers={**dict(page.headers), "X-Bench-Log": "1"})
    if warm.status != page.status:
        raise SystemExit(f"GET {page.path}: {warm.status}\n{warm.body[:500]!r}")
    result.bytes = len(warm.body)
    for _ in range(requests):
        started = time.perf_counter()
        response = session.get(page.path, headers=dict(page.headers))
        result.ms.append((time.perf_counter() - started) * 1000)
        if response.status != page.status:
            raise SystemExit(f"GET {page.path}: {response.status}")
        result.queries.append(int(response.header("x-queries", "-1")))
        result.db_ms.append(float(response.header("x-db-ms", "0")))
        result.server_ms.append(float(response.header("x-server-ms", "0")))
    return result


def attach_sql(results: list[Measurement], log_path: Path) -> None:
    """The warm-up requests' queries, from the server's SQL log."""
    by_path: dict[str, list[dict]] = {}
    if log_path.exists():
        for line in log_path.read_text().splitlines():
            record = json.loads(line)
            by_path[record["path"]] = record["queries"]
    for m in results:
        m.sql = by_path.get(m.page.path, [])


def uncapped_counts(db_url: str, results: list[Measurement]) -> None:
    """Each ``COUNT(`` without a ``LIMIT`` of each page, with the rows its scans read
    (EXPLAIN ANALYZE): more than COUNT_CAP is a full count."""
    for m in results:
        for query in m.sql:
            text = query["sql"]
            if FULL_COUNT.search(text) and "LIMIT" not in text.upper():
                m.uncapped.append({"sql": text, "ms": query["ms"], "rows_read": rows_read(db_url, text)})


def rows_read(db_url: str, query: str) -> int:
    """Rows produced by the plan's leaf scans (times their loops), as EXPLAIN ANALYZE counts them."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + query).fetchone()  # type: ignore[arg-type]
    assert row is not None

    def leaves(node: dict) -> int:
        children = node.get("Plans", [])
        if not children:
            return int(node.get("Actual Rows", 0) * node.get("Actual Loops", 1) + node.get("Rows Removed by Filter", 0))
        return sum(leaves(child) for child in children)

    return leaves(row[0][0]["Plan"])


def explain(db_url: str, query: str) -> str:
    if not query.lstrip().upper().startswith("SELECT"):
        return "(not a SELECT: not explained)"
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + query).fetchall()  # type: ignore[arg-type]
    return "\n".join(row[0] for row in rows)


def print_explains(db_url: str, results: list[Measurement], everything: bool) -> None:
    for m in results:
        if not everything and m.meets_target:
            continue
        slow = m.slowest
        print(f"--- {m.page.name} ({m.page.path}): p95 {m.p95:.1f} ms; slowest query {slow['ms']:.1f} ms of "
              f"{len(m.sql)} ({sum(x['ms'] for x in m.sql):.1f} ms in SQL)")  # fmt: skip
        print(slow["sql"])
        print(explain(db_url, slow["sql"]))
        print()


def print_table(results: list[Measurement]) -> None:
    header = (
        f"{'page':<34}{'group':<10}{'p50 ms':>8}{'p95 ms':>8}{'server':>8}{'queries':>8}{'SQL ms':>8}{'slowest':>9}"
    )
    print(header + "  target")
    print("-" * (len(header) + 8))
    for m in results:
        mark = "—" if m.page.group not in TARGET_GROUPS else ("ok" if m.meets_target else "MISS")
        if m.uncapped:
            rows = max(u["rows_read"] for u in m.uncapped)
            mark += f" {'FULL' if m.full_counts else 'uncapped'} COUNT ({rows:,} rows read)"
        if m.duplicates:
            mark += f" {m.duplicates} repeated"
        print(
            f"{m.page.name:<34}{m.page.group:<10}{m.p50:>8.1f}{m.p95:>8.1f}{statistics.median(m.server_ms):>8.1f}"
            f"{m.max_queries:>8}{statistics.median(m.db_ms):>8.1f}{m.slowest['ms']:>9.1f}  {mark}"
        )


def verdict(results: list[Measurement], max_queries: int) -> dict:
    """Queries are constant when the list pages (50 rows or 1) issue as many, but for the
    OPTIONAL_READS a page skips when none of its runs is unfinished (the steps and the pending
    requests its "why" sentences read), the run page with 1,000 audit events as many as a run
    in the same state with ten, and none more than ``max_queries``: no N+1."""
    by_name = {m.page.name: m for m in results}
    listing = {m.max_queries for m in results if m.page.group in ("list", "filter", "search")}
    same_state = {by_name[name].max_queries for name in (DETAIL_BIG, DETAIL_SAME_STATE) if name in by_name}
    constant = (
        (max(listing) - min(listing) <= OPTIONAL_READS if listing else True)
        and len(same_state) <= 1
        and max(m.max_queries for m in results) <= max_queries
    )
    return {
        "p95_under_100ms": all(m.meets_target for m in results),
        "misses": [name for name, m in by_name.items() if not m.meets_target],
        "queries_constant": constant,
        "queries_per_page": {name: m.max_queries for name, m in by_name.items()},
        "repeated_queries": {name: m.duplicates for name, m in by_name.items() if m.duplicates},
        "uncapped_counts": {
            name: [{"rows_read": u["rows_read"], "ms": u["ms"], "sql": u["sql"][:200]} for u in m.uncapped]
            for name, m in by_name.items()
            if m.uncapped
        },
        "no_full_count": not any(m.full_counts for m in results),
    }


def run(args: argparse.Namespace) -> int:
    load_before = os.getloadavg()
    with seed.bench_run(args, prefix="bench_console") as (db, work):
        sql_log = work / "sql.jsonl"
        seed.manage(db.url, "migrate", "--noinput")  # a reused database gets newer migrations
        username, password = create_supervisor(db.url)
        env = {
            "BENCH_SQL_LOG": str(sql_log),
            "DATABASE_CONN_MAX_AGE": str(args.conn_max_age),
            "RECOVERY_METRICS_TOKEN": METRICS_TOKEN,
            "PROMETHEUS_MULTIPROC_DIR": str(work / "prometheus"),  # as production runs gunicorn
        }
        with Server(db.url, work, workers=1, env=env) as server:
            session = Session(server.port)
            session.login(username, password)
            to_measure = pages(session, db.url, db.info, deep_page(session, args.deep_page))
            results = []
            for page in to_measure:
                seed.log(f"measuring {page.name}")
                results.append(measure(session, page, args.requests))
        attach_sql(results, sql_log)
        uncapped_counts(db.url, results)
        print_explains(db.url, results, args.explain == "all")
        print_table(results)
        targets = verdict(results, args.max_queries)
        summary = {
            "database": db.name,
            "runs": db.info["runs"],
            "steps": db.info["steps"],
            "audit_events": db.info["audit"],
            "requests_per_page": args.requests,
            "conn_max_age": args.conn_max_age,
            "pages": {
                m.page.name: {
                    "path": m.page.path,
                    "group": m.page.group,
                    "p50_ms": round(m.p50, 1),
                    "p95_ms": round(m.p95, 1),
                    "server_p50_ms": round(statistics.median(m.server_ms), 1),
                    "queries": m.max_queries,
                    "sql_ms": round(statistics.median(m.db_ms), 1),
                    "slowest_query_ms": m.slowest["ms"],
                    "bytes": m.bytes,
                    "repeated_queries": m.duplicates,
                }
                for m in results
            },
            "targets": targets,
            "all_targets_hold": targets["p95_under_100ms"] and targets["queries_constant"] and targets["no_full_count"],
        }
        seed.print_summary(summary, load_before)
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    seed.add_database_arguments(parser, default_runs=20_000, prefix="bench_console")
    parser.add_argument("--requests", type=int, default=20, help="timed requests per page (20)")
    parser.add_argument("--deep-page", type=int, default=500, help="the runs list page reached by next links (500)")
    parser.add_argument("--max-queries", type=int, default=30, help="the most queries a page may issue (30)")
    parser.add_argument("--conn-max-age", type=int, default=0, help="DATABASE_CONN_MAX_AGE of the server (0)")
    parser.add_argument(
        "--explain", choices=("misses", "all"), default="misses", help="EXPLAIN the slowest query of these pages"
    )
    sys.exit(run(parser.parse_args()))


if __name__ == "__main__":
    main()
