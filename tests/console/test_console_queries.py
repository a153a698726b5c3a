"""The console's pages issue a fixed number of queries (no N+1, nothing asked twice), search
merges its branches without changing what it finds, and the run page shows a bounded amount of
history whatever the run's length."""

import hashlib
import re
from datetime import timedelta
from urllib.parse import quote

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import connection
from django.db.models import Q
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from recovery import clock as engine_clock
from recovery.console import selectors
from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunState, StepExecution, StepState, WorkflowRun
from recovery.permissions import Role, role_of
from tests.support import receivers
from tests.support.console import failed_run, login
from tests.support.engine import drive

pytestmark = pytest.mark.django_db(transaction=True)

# Pinned: a new query on these pages (an N+1, a repeated look-up) must be a deliberate change.
# Session, user, the role (once), the page of runs, the steps and the pending four-eyes requests
# of its unfinished runs ("why is it not moving"), 10 state counts and 8 stuck counts (the other
# two causes are states: counted once).
# Session, user, role, the page of runs, their steps and approval requests (for "why"); the
# counts come in the counts part's own request: the state counts in one query, the stuck
# causes in one more. The whole page also reads the workflow names its runs have (the filter's
# choices: old runs of a workflow no longer registered included), one index entry per name, and
# the versions of runs stuck because their version is not deployed (the version filter's choices
# beside the registered ones: a short walk of the runs in progress, no count).
# A whole page (base.html) also reads whether any executor is live (the "no executor" banner):
# one aggregate over the executors' few rows; an htmx part does not. And the pauses of a workflow
# in force (the incident banner: issue 37), one read of a small table (two more while some hold).
RUNS_PAGE_QUERIES = 10
RUNS_TABLE_QUERIES = 6  # an htmx refresh of the table: no filter form
# The counts part (on load, and its refresh): no page of runs; the state counts, the stuck
# counts, and the total of runs matching the filters ("1,234 runs", capped too).
COUNTS_QUERIES = 6
# Session, user, role, the run, its steps, audit events, decisions, outbox, alerts (their deliveries
# only when it has some), saved versions, timeline, its stuck causes, its restarts, and whether any
# executor is live.
RUN_PAGE_QUERIES = 14

SEARCH = "order:t:a"


def queries_of(client: Client, url: str, **headers) -> list[str]:
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url, headers=headers)
    assert response.status_code == 200
    return [q["sql"] for q in captured.captured_queries]


def role_queries(sqls: list[str]) -> list[str]:
    return [sql for sql in sqls if "auth_group" in sql]


def repeated(sqls: list[str]) -> list[str]:
    return sorted({sql for sql in sqls if sqls.count(sql) > 1})


# --- queries per page -----------------------------------------------------------------


def test_the_runs_list_and_its_htmx_parts_issue_a_pinned_number_of_queries(clock):
    for i in range(3):
        failed_run(clock, f"q-{i}")
    receivers.arm("ledger", "forbidden")  # a task and a message stand: stuck (stuck=any lists it)
    drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "q-late"})[0], clock)
    viewer = login("viewer")
    url = reverse("console:runs")

    page = queries_of(viewer, url)
    assert len(page) == RUNS_PAGE_QUERIES, page
    assert len(role_queries(page)) == 1 and repeated(page) == []
    assert not any("COUNT(" in sql.upper() for sql in page)  # the counts come apart

    for params in ("?state=failed", "?stuck=any", "?q=order:t:q-late", "?key=order:t", "?after=1000000"):
        assert len(queries_of(viewer, url + params)) == RUNS_PAGE_QUERIES, params  # search is one query too
    # A page without a run to explain reads no steps and no requests.
    assert len(queries_of(viewer, url + f"?q={SEARCH}")) == RUNS_PAGE_QUERIES - 2

    table = queries_of(viewer, url, **{"HX-Request": "true", "HX-Target": "runs-table"})
    assert len(table) == RUNS_TABLE_QUERIES and not any("COUNT(" in sql.upper() for sql in table)
    counts = queries_of(viewer, url, **{"HX-Request": "true", "HX-Target": "counts"})
    assert len(counts) == COUNTS_QUERIES and repeated(counts) == []
    capped = [sql for sql in counts if "COUNT(" in sql.upper()]
    assert len(capped) == 3 and all(sql.upper().count("LIMIT") >= sql.upper().count("COUNT(") for sql in capped)


def test_the_htmx_table_refresh_skips_the_counts_and_the_full_page_fetches_them_apart(clock):
    failed_run(clock)
    viewer = login("viewer")
    url = reverse("console:runs") + "?state=failed"
    table = viewer.get(url, headers={"HX-Request": "true", "HX-Target": "runs-table"})
    assert "state_counts" not in table.context and "stuck_counts" not in table.context
    assert "order:t:o-1" in table.text
    counts = viewer.get(url, headers={"HX-Request": "true", "HX-Target": "counts"})
    assert "runs" not in counts.context and 'id="counts"' in counts.text
    assert {c["state"]: c["count"] for c in counts.context["state_counts"]}["failed"] == 1
    assert "Failed <b>1</b>" in counts.text
    # The whole page: every chip to click at once, and its number fetched by the counts part.
    full = viewer.get(url)
    assert "order:t:o-1" in full.text and "Failed <b>…</b>" in full.text and "Unknown outcome <b>…</b>" in full.text
    assert 'hx-trigger="load, every 10s"' in full.text
    assert all(c["count"] is None for c in full.context["state_counts"] + full.context["stuck_counts"])


def test_the_run_page_issues_as_many_queries_for_a_long_run_as_for_a_short_one(clock):
    long_run = failed_run(clock, "long")
    short_run = failed_run(clock, "short")
    add_events(long_run, 400)
    operator = login("operator")  # the role that sees the most actions: can() asked most often

    long_queries = queries_of(operator, reverse("console:run", args=[long_run.workflow_id]))
    short_queries = queries_of(operator, reverse("console:run", args=[short_run.workflow_id]))
    assert len(long_queries) == len(short_queries) == RUN_PAGE_QUERIES, long_queries
    assert len(role_queries(long_queries)) == 1 and repeated(long_queries) == []


def test_the_role_is_read_once_per_user_object(clock):
    user = get_user_model().objects.create_user("once")
    user.groups.add(Group.objects.get_or_create(name="operator")[0])
    with CaptureQueriesContext(connection) as captured:
        assert [role_of(user) for _ in range(5)] == [Role.OPERATOR] * 5
    assert len(captured) == 1
    fresh = get_user_model().objects.get(pk=user.pk)  # the next request's user
    fresh.groups.set([Group.objects.get_or_create(name="supervisor")[0]])
    assert role_of(fresh) == Role.SUPERVISOR


# --- search ---------------------------------------------------------------------------


def make_runs() -> None:
    """Runs interleaved by id: ``order:t:a-*`` (the workflow id begins with SEARCH),
    ``order:t:b-*`` with a step whose remote reference or idempotency key is SEARCH, some
    matching both ways, and runs matching neither."""
    now = engine_clock.now()
    runs, steps = [], []
    for i in range(180):
        kind = "abcd"[i % 4] if i % 7 else "a"
        runs.append(
            WorkflowRun(
                workflow_id=f"order:t:{kind}-{i:03d}",
                workflow_name="test_orders",
                workflow_version=1,
                state=RunState.FAILED if i % 3 == 0 else RunState.COMPLETED,
                input={},
                input_hash="",
                created_at=now - timedelta(minutes=i),
                updated_at=now,
            )
        )
    WorkflowRun.objects.bulk_create(runs)
    for run in WorkflowRun.objects.filter(workflow_id__startswith="order:t:"):
        n = int(run.workflow_id[-3:])
        by_ref = run.workflow_id.startswith("order:t:b") or n % 5 == 0  # a-runs among them match twice
        steps.append(
            StepExecution(
                run=run,
                step_name="create_task",
                position=0,
                key_version=1,
                idempotency_key=SEARCH if n == 2 else f"key-{n}",  # the idempotency-key branch, once
                remote_ref=SEARCH if by_ref else f"task-{n}",
                state=StepState.UNKNOWN if n % 4 == 1 else StepState.FAILED,  # stuck: unknown outcome
                updated_at=now,
            )
        )
    StepExecution.objects.bulk_create(steps)


def reference(filters: selectors.RunFilters) -> list[int]:
    """What the search matched before it was split: the OR of its ways, newest first."""
    qs = filters._narrowed(engine_clock.now())
    q = filters.q
    hex_prefix = Q(idempotency_key__startswith=q.lower()) if re.fullmatch(r"[0-9a-fA-F]+", q) else Q(pk__in=[])
    by_step = StepExecution.objects.filter(
        Q(idempotency_key=q) | hex_prefix | Q(remote_ref__icontains=q) | Q(compensation_ref__icontains=q)
    ).values("run_id")
    return list(qs.filter(Q(workflow_id__icontains=q) | Q(pk__in=by_step)).order_by("-pk").values_list("pk", flat=True))


def paged(client: Client, params: str) -> list[int]:
    """Every run of the list, following its keyset pages."""
    ids, after = [], None
    while True:
        response = client.get(reverse("console:runs") + params + (f"&after={after}" if after else ""))
        ids += [run.pk for run in response.context["runs"]]
        after = response.context["next_cursor"]
        if after is None:
            return ids


@pytest.mark.parametrize("extra", ["", "&state=failed", "&stuck=any", "&key=order:t:b", "&age=1h"])
def test_search_pages_find_what_the_or_found_in_the_same_order(clock, extra):
    make_runs()
    filters = selectors.RunFilters.from_params(dict(p.split("=") for p in f"q={SEARCH}{extra}".split("&")))
    expected = reference(filters)
    assert len(expected) > 0
    if not extra:
        assert len(expected) > 2 * selectors.PAGE_SIZE  # several pages, both branches interleaved
    assert paged(login("viewer"), f"?q={SEARCH}{extra}") == expected
    assert [r.pk for r in filters.newest(engine_clock.now(), limit=7)] == expected[:7]
    assert sorted(filters.queryset(engine_clock.now()).values_list("pk", flat=True)) == sorted(expected)


def test_search_by_an_exact_idempotency_key_or_remote_ref_finds_old_runs(clock):
    make_runs()
    by_key = selectors.RunFilters(q="key-179")
    assert [r.workflow_id for r in by_key.newest(engine_clock.now(), limit=51)] == ["order:t:d-179"]
    by_ref = selectors.RunFilters(q="task-178")
    assert [r.workflow_id for r in by_ref.newest(engine_clock.now(), limit=51)] == ["order:t:c-178"]
    assert list(selectors.RunFilters(q="nothing-like-it").newest(engine_clock.now(), limit=51)) == []


def test_bulk_on_all_runs_matching_a_search_is_not_limited_to_a_page(clock):
    make_runs()
    filters = selectors.RunFilters(q=SEARCH, state=RunState.FAILED)
    expected = set(reference(filters))
    assert len(expected) > 0
    supervisor = login("supervisor")
    data = {"action": "terminate", "reason": "bad batch", "all_matching": "1", "q": SEARCH, "state": "failed"}
    preview = supervisor.post(reverse("console:bulk"), data)
    assert f"<b>{len(expected)}</b> of {len(expected)} selected runs would be changed" in preview.text
    assert not WorkflowRun.objects.filter(state=RunState.TERMINATED).exists()
    response = supervisor.post(reverse("console:bulk"), {**data, "confirm": "yes"})
    assert response.status_code == 200 and f"{len(expected)} runs changed" in response.text
    assert set(WorkflowRun.objects.filter(state=RunState.TERMINATED).values_list("pk", flat=True)) == expected

    everything = selectors.RunFilters(q=SEARCH)
    assert len(reference(everything)) > selectors.PAGE_SIZE
    ids = list(everything.newest(engine_clock.now(), limit=500).values_list("pk", flat=True))
    assert ids == reference(everything)  # the bulk's selection: every match, newest first


# --- the run page ---------------------------------------------------------------------


def add_events(run: WorkflowRun, n: int) -> None:
    start = run.audit_events.order_by("-at").first().at
    AuditEvent.objects.bulk_create(
        AuditEvent(
            run=run,
            at=start + timedelta(seconds=i + 1),
            step_name="create_task",
            actor="executor",
            action=("step_begin", "step_fail")[i % 2],
            reason=f"event {i}",
            before={"n": i},
            after={"n": i + 1},
        )
        for i in range(n)
    )


def test_the_run_page_shows_the_latest_events_versions_and_attempts_and_links_the_full_trail(clock):
    run = failed_run(clock, "storm")
    add_events(run, 300)
    for i in range(selectors.AUDIT_SHOWN + 5):  # versions saved by people
        run.status_reason = f"note {i}"
        run.save(update_fields=["status_reason"])
    page = login("viewer").get(reverse("console:run", args=[run.workflow_id]))
    context = page.context

    assert len(context["audit"]) == selectors.AUDIT_SHOWN == 50 and context["audit_truncated"]
    assert [e.reason for e in context["audit"][:2]] == ["event 299", "event 298"]  # newest first
    assert "event 249" not in page.text and "event 250" in page.text
    assert f"The latest {selectors.AUDIT_SHOWN} events are shown" in page.text
    trail = f"?format=csv&amp;run={quote(run.workflow_id, safe='/')}"
    assert page.text.count(trail) == 2 and "JSON Lines" in page.text  # the header's link and the note's

    assert len(context["versions"]) == selectors.AUDIT_SHOWN and context["versions_truncated"]
    assert context["versions"][0].status_reason == f"note {selectors.AUDIT_SHOWN + 4}"

    timeline = context["timeline"]
    # Each attempt (a begin and its outcome: two events) is one bar.
    assert len(timeline["bars"]) == selectors.TIMELINE_POINTS // 2 and timeline["truncated"] and not timeline["marks"]
    assert page.text.count('class="attempt ') == selectors.TIMELINE_POINTS // 2
    assert "The latest 100 events" in page.text
    xs = [b["x"] for b in timeline["bars"]]
    assert xs == sorted(xs) and xs[0] == timeline["left"] + 8  # oldest shown at the start of the axis
    assert timeline["end"] == run.audit_events.order_by("-at").first().at


def test_a_short_run_shows_its_whole_history_and_timeline(clock):
    run = failed_run(clock)
    page = login("viewer").get(reverse("console:run", args=[run.workflow_id]))
    context = page.context
    assert not context["audit_truncated"] and not context["versions_truncated"]
    assert len(context["audit"]) == run.audit_events.count()
    assert not context["timeline"]["truncated"] and context["timeline"]["start"] == run.created_at
    assert "The latest" not in page.text


def test_search_finds_a_part_of_an_id_or_a_reference_whatever_its_case_and_says_what_it_searched(clock):
    make_runs()
    viewer = login("viewer")
    found = lambda q: {r.workflow_id for r in viewer.get(reverse("console:runs"), {"q": q}).context["runs"]}  # noqa: E731
    ids = list(WorkflowRun.objects.values_list("workflow_id", flat=True))
    assert found("C-01") == {w for w in ids if "c-01" in w} != set()  # inside the id, any case
    assert found("T:D-02") == {w for w in ids if "t:d-02" in w} != set()
    run = WorkflowRun.objects.get(workflow_id="order:t:c-010")
    step = run.steps.first()
    key = hashlib.sha256(b"order:t:c-010:create_task:v1").hexdigest()  # keys are lowercase hex
    StepExecution.objects.filter(pk=step.pk).update(
        remote_ref="TASK_4711", compensation_ref="cancel_9001", idempotency_key=key
    )
    assert found("task_47") == found("4711") == {"order:t:c-010"}
    assert found("CANCEL_90") == {"order:t:c-010"}  # a compensation's reference too
    assert found(key[:10].upper()) == {"order:t:c-010"}  # the beginning of a key, any case
    assert found(key) == {"order:t:c-010"}
    # A long text is looked up by its most distinctive word, and the whole text decides.
    for tenant in ("acme", "globex"):
        run_start(workflow="test_orders", data={"tenant": tenant, "order_id": "INV-2024-0050000"})
    assert selectors._distinctive("order:acme:INV-2024-0050000") == "0050000"
    assert found("order:ACME:inv-2024-0050000") == {"order:acme:INV-2024-0050000"}
    assert found("2024-0050000") == {"order:acme:INV-2024-0050000", "order:globex:INV-2024-0050000"}
    assert found("order:acme:INV-2024-0050001") == set()
    empty = viewer.get(reverse("console:runs"), {"q": "nothing-like-this", "state": "failed"}).text
    assert "No run has “nothing-like-this” in its workflow id, business key or a remote reference" in empty
    assert "among the runs that are failed" in empty and "Search every run" in empty
