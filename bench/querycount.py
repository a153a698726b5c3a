"""Count the SQL queries of each request, server-side (``bench/console_settings.py`` installs it).

Every response gets ``X-Queries`` (queries on the default database during the request, template
rendering included), ``X-DB-ms`` (their total time) and ``X-Server-ms`` (the whole request in
Django). A request sent with ``X-Bench-Log: 1`` also appends one JSON line to the file named by
``BENCH_SQL_LOG``: its path, status and every query as PostgreSQL received it (parameters
inlined) with its time, so that the benchmark can flag full counts and EXPLAIN the slowest
query. A streamed response's queries run after the view returns and are not counted.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from django.db import connection
from django.http import HttpRequest, HttpResponse


class QueryCounter:
    def __init__(self, *, keep_sql: bool) -> None:
        self.keep_sql = keep_sql
        self.count = 0
        self.seconds = 0.0
        self.queries: list[dict[str, Any]] = []

    def __call__(self, execute: Callable, sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            elapsed = time.perf_counter() - started
            self.count += 1
            self.seconds += elapsed
            self.observed(sql, params, elapsed)

    def observed(self, sql: str, params: Any, elapsed: float) -> None:
        """One statement counted (a subclass keeps what else it needs of it)."""
        if self.keep_sql:
            try:
                text = connection.ops.compose_sql(sql, params) if params else sql
            except Exception:  # noqa: BLE001 - a query that cannot be composed is still counted
                text = sql
            self.queries.append({"sql": text, "ms": round(elapsed * 1000, 3)})


class QueryCountMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        self.log_path = os.environ.get("BENCH_SQL_LOG")

    def __call__(self, request: HttpRequest) -> HttpResponse:
        keep_sql = bool(self.log_path) and request.headers.get("X-Bench-Log") == "1"
        counter = QueryCounter(keep_sql=keep_sql)
        started = time.perf_counter()
        with connection.execute_wrapper(counter):
            response = self.get_response(request)
        response["X-Queries"] = str(counter.count)
        response["X-DB-ms"] = f"{counter.seconds * 1000:.2f}"
        response["X-Server-ms"] = f"{(time.perf_counter() - started) * 1000:.2f}"
        if keep_sql and self.log_path:
            record = {"path": request.get_full_path(), "status": response.status_code, "queries": counter.queries}
            with open(self.log_path, "a", encoding="utf-8") as file:
                file.write(json.dumps(record) + "\n")
        return response
