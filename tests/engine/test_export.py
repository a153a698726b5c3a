"""Auditors export audit trails (`export_audit --format csv|jsonl`): every
audit event, in order, filterable, safe to open in a spreadsheet, streamed in constant memory,
and only for users allowed to read the console."""

import csv
import json
import re
import tracemalloc
import warnings
from datetime import UTC, datetime, timedelta
from io import StringIO

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from recovery.engine.audit import export as exports
from recovery.engine.audit.export import COLUMNS, AuditFilters, audit_events, csv_lines, jsonl_lines, parse_filters
from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunState, WorkflowRun
from tests.support.engine import drive

pytestmark = pytest.mark.django_db

URL = "/audit/export"
MAY_1 = datetime(2024, 5, 1, tzinfo=UTC)


def start(key: str = "o1", *, workflow: str = "test_orders", now: datetime | None = None) -> WorkflowRun:
    """A run started through the engine (with its "start" audit event): order:t:<key> or invoice:t:<key>."""
    if workflow == "test_orders":
        data = {"tenant": "t", "order_id": key}
    else:
        data = {"tenant": "t", "invoice_id": key, "text": "2 chairs, total EUR 80.00"}
    run, _ = run_start(workflow=workflow, data=data, now=now)
    return run


def add_event(run: WorkflowRun, at: datetime, **fields) -> AuditEvent:
    values = {"actor": "executor", "action": "step_succeed", "step_name": "", "reason": "", "before": {}, "after": {}}
    return AuditEvent.objects.create(run=run, at=at, **{**values, **fields})


def export_text(params: dict, **kwargs) -> str:
    return "".join(exports.export_chunks(parse_filters(params), **kwargs))


# Where an export's trailer starts (recovery.engine.audit.trailer): a line of its own after the events.
TRAILER = re.compile(r'(?:^|(?<=\n))(?:\{"trailer":|trailer,|trailer_total,)')


def events_of(text: str) -> str:
    """An export's events (and CSV header), without its trailer."""
    found = TRAILER.search(text)
    assert found is not None, "the export has no trailer"
    return text[: found.start()]


def csv_rows(text: str) -> list[list[str]]:
    return list(csv.reader(StringIO(text, newline="")))


def exported_ids(**params) -> list[int]:
    return [e.id for e in audit_events(parse_filters(params))]


def user_in(group: str | None, username: str = "vera"):
    user = get_user_model().objects.create_user(username)
    if group:
        user.groups.add(Group.objects.get(name=group))
    return user


def run_cmd(*args) -> str:
    out = StringIO()
    call_command("export_audit", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


# --- formats --------------------------------------------------------------------------


def test_csv_is_a_header_then_every_event_of_a_real_run_in_at_then_id_order(clock):
    run = drive(start(), clock)
    assert run.state == RunState.COMPLETED
    events = list(AuditEvent.objects.select_related("run").order_by("at", "id"))
    assert len(events) > 5

    header, *rows = csv_rows(events_of(export_text({"format": "csv"})))

    assert header == list(COLUMNS)
    assert len(rows) == len(events)
    for row, event in zip(rows, events, strict=True):
        at, workflow_id, workflow, step, actor, action, reason, before, after, event_id, prev_hash, digest = row
        assert datetime.fromisoformat(at) == event.at and at.endswith("+00:00")
        assert (workflow_id, workflow, step, actor, action, reason) == (
            run.workflow_id,
            "test_orders",
            event.step_name,
            event.actor,
            event.action,
            event.reason,
        )
        assert (json.loads(before), json.loads(after), int(event_id)) == (event.before, event.after, event.id)
        assert (prev_hash, digest) == (event.prev_hash, event.hash) and len(digest) == 64
    assert rows[0][10] == "" and all(row[10] == previous[11] for previous, row in zip(rows, rows[1:], strict=False))
    assert rows[0][5] == "start" and json.loads(rows[-1][8])["run"] == "completed"


def test_jsonl_is_one_compact_object_per_line_with_before_and_after_as_objects(clock):
    drive(start(), clock)
    events = list(AuditEvent.objects.order_by("at", "id"))

    text = events_of(export_text({"format": "jsonl"}))

    lines = text.splitlines()
    assert text.endswith("\n") and len(lines) == len(events)
    for line, event in zip(lines, events, strict=True):
        doc = json.loads(line)
        assert list(doc) == list(COLUMNS)
        assert line == json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
        assert (doc["event_id"], doc["before"], doc["after"]) == (event.id, event.before, event.after)
        assert (doc["prev_hash"], doc["hash"]) == (event.prev_hash, event.hash) and len(event.hash) == 64
        assert isinstance(doc["before"], dict) and datetime.fromisoformat(doc["at"]) == event.at


def test_json_columns_are_compact_with_sorted_keys_in_both_formats():
    run = start()
    add_event(run, MAY_1, before={"z": 1, "a": {"y": [2, {"d": 1, "c": 0}], "b": "é"}}, after={"run": "x"})
    [event] = AuditEvent.objects.filter(at=MAY_1).select_related("run")

    [csv_row] = csv_rows("".join(csv_lines([event])))[1:]
    [jsonl_line] = list(jsonl_lines([event]))

    assert csv_row[7] == '{"a":{"b":"é","y":[2,{"c":0,"d":1}]},"z":1}'
    assert '"before":{"a":{"b":"é","y":[2,{"c":0,"d":1}]},"z":1},"after":{"run":"x"}' in jsonl_line


def test_events_sharing_a_timestamp_are_neither_lost_nor_repeated_across_batch_boundaries():
    """Keyset pagination over (at, id): a batch may end in the middle of equal timestamps."""
    run = start(now=MAY_1 - timedelta(days=1))
    created = [add_event(run, MAY_1 + timedelta(seconds=i // 5), reason=str(i)).id for i in range(23)]
    expected = [run.audit_events.get(action="start").id, *created]

    for batch_size in (1, 3, 5, 7, 100):
        assert [e.id for e in audit_events(AuditFilters(), batch_size=batch_size)] == expected


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_the_export_written_by_the_database_is_the_python_one_across_batches_and_ties(monkeypatch, fmt):
    """On PostgreSQL the database writes the lines, COPY_BATCH_SIZE events per COPY; the bytes
    are csv_lines' / jsonl_lines', whatever the batch size and with batches ending amid equal
    timestamps (elsewhere both sides are the Python writer)."""
    run = start(now=MAY_1 - timedelta(days=1))
    for i in range(23):
        add_event(run, MAY_1 + timedelta(seconds=i // 5), reason=f'{i},\n"{i}"', before={"i": i, "é": [i]})
    filters = parse_filters({"format": fmt})
    lines = "".join(exports.FORMATS[fmt].lines(audit_events(filters)))
    expected = "".join(exports.export_chunks(filters, events=audit_events(filters)))  # the Python writer
    assert lines.count("\n") >= 24 and events_of(expected) == lines
    for size in (1, 3, 5, 7, 100):
        monkeypatch.setattr(exports, "COPY_BATCH_SIZE", size)
        count = exports.ExportCount()
        assert "".join(exports.export_chunks(filters, count=count)) == expected, size
        assert count.events == 24


def test_cells_that_a_spreadsheet_would_run_as_formulas_are_prefixed_with_a_quote():
    now = MAY_1 - timedelta(days=1)
    run = WorkflowRun.objects.create(
        workflow_id="=HYPERLINK(1)",
        workflow_name="-wf",
        workflow_version=1,
        input={},
        input_hash="0" * 64,
        created_at=now,
        updated_at=now,
    )
    add_event(run, MAY_1, step_name="+step", actor="@admin", action="-2+3", reason="=SUM(A1:A9)")
    add_event(run, MAY_1 + timedelta(seconds=1), actor="\tcmd", reason="\r=1+1", before={"x": "=1"})
    add_event(run, MAY_1 + timedelta(seconds=2), actor="a=b", reason="safe -1 +1 @x", after={"y": "-1"})

    _, first, second, third = csv_rows(events_of(export_text({"format": "csv"})))

    assert first[1:7] == ["'=HYPERLINK(1)", "'-wf", "'+step", "'@admin", "'-2+3", "'=SUM(A1:A9)"]
    assert (second[4], second[6]) == ("'\tcmd", "'\r=1+1")
    assert third[4:7] == ["a=b", "step_succeed", "safe -1 +1 @x"]  # only the first character matters
    for row in (first, second, third):  # timestamps, JSON and ids parse back untouched
        assert datetime.fromisoformat(row[0]) and json.loads(row[7]) is not None and json.loads(row[8]) is not None
        assert row[9].isdigit()
    # JSON Lines is not for spreadsheets: the stored values, unchanged.
    docs = [json.loads(line) for line in events_of(export_text({"format": "jsonl"})).splitlines()]
    assert [d["actor"] for d in docs] == ["@admin", "\tcmd", "a=b"] and docs[0]["workflow_id"] == "=HYPERLINK(1)"


def _previous_lines(fmt: str, events) -> list[str]:
    """The export as it was written before it read plain rows: from model instances, each row
    a dict, ``before``/``after`` re-encoded by ``json.dumps`` (kept to prove the output did not
    change by a byte)."""
    from recovery.engine.audit.export import FORMULA_TRIGGERS, _Echo

    def row(event):
        return {
            "at": event.at.astimezone(UTC).isoformat(timespec="microseconds"),
            "workflow_id": event.run.workflow_id,
            "workflow": event.run.workflow_name,
            "step": event.step_name,
            "actor": event.actor,
            "action": event.action,
            "reason": event.reason,
            "before": event.before,
            "after": event.after,
            "event_id": event.id,
            "prev_hash": event.prev_hash,
            "hash": event.hash,
        }

    def sorted_keys(value):
        if isinstance(value, dict):
            return {key: sorted_keys(value[key]) for key in sorted(value)}
        if isinstance(value, list):
            return [sorted_keys(item) for item in value]
        return value

    def compact(value):
        return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)

    if fmt == "jsonl":
        return [
            json.dumps({**r, "before": sorted_keys(r["before"]), "after": sorted_keys(r["after"])},
                       separators=(",", ":"), ensure_ascii=False) + "\n"
            for r in map(row, events)
        ]  # fmt: skip
    writer = csv.writer(_Echo())
    lines = [writer.writerow(COLUMNS)]
    for r in map(row, events):
        r["before"], r["after"] = compact(r["before"]), compact(r["after"])
        lines.append(
            writer.writerow(
                [("'" + v if v.startswith(FORMULA_TRIGGERS) else v) if isinstance(v, str) else v for v in r.values()]
            )
        )
    return lines


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_the_export_is_byte_for_byte_what_it_was_when_it_built_model_instances(clock, fmt):
    """Rows are read as plain values and written without building a dict per row; the output
    is the same, for awkward values too (nesting, key order, unicode, quotes, newlines, numbers,
    JSON null, formula-like JSON, a timestamp without microseconds)."""
    run = drive(start("bytes"), clock)
    odd = WorkflowRun.objects.create(
        workflow_id='=odd:"quoted",id',
        workflow_name="wf\nname",
        workflow_version=1,
        input={},
        input_hash="0" * 64,
        created_at=MAY_1,
        updated_at=MAY_1,
    )
    values = [
        {"z": 1, "a": {"y": [2, {"d": 1, "c": 0}], "b": "é ü 😀 \u2028"}, "m": None, "f": 1.5, "t": True},
        {"quote": 'say "hi", ok', "nl": "line\nbreak\r\n", "tab": "\t", "bs": "\\", "ctl": "\x01"},
        [3, "=1+1", {"b": 2, "a": 1}],
        "-1",
        -1,
        {},
        {"10": 1, "9": 2, "a": 3, "B": 4, "é": 5, "": 6},
        12345678901234567890,
        -0.0,
        1e100,
    ]
    for i, value in enumerate(values):
        add_event(odd, MAY_1 + timedelta(seconds=i), before=value, after=values[-1 - i], reason=f'r{i},"x"\n')
    add_event(odd, MAY_1.replace(microsecond=0) + timedelta(days=1), actor="=a", step_name="-s", action="@b")
    add_event(run, MAY_1 + timedelta(microseconds=7), actor="ünïcode", reason="")

    events = list(AuditEvent.objects.select_related("run").order_by("at", "id"))
    expected = "".join(_previous_lines(fmt, events))
    exported = export_text({"format": fmt})
    assert events_of(exported) == expected
    # The trailer too, whichever writer (on PostgreSQL the database's) wrote the events:
    assert exported == "".join(exports.export_chunks(AuditFilters(format=fmt), events=events))
    assert export_text({"format": fmt}, chunk_chars=1) == exported
    assert "".join(exports.FORMATS[fmt].lines(events)) == expected  # model instances still work


# --- filters --------------------------------------------------------------------------


@pytest.fixture
def trail() -> dict[str, AuditEvent]:
    """Three runs (two workflows) with events on and around the May 1st–2nd boundaries."""
    earlier = MAY_1 - timedelta(days=1)
    o1, o2, inv = start("o1", now=earlier), start("o2", now=earlier), start("i1", workflow="invoice", now=earlier)
    return {
        "o1.start": o1.audit_events.get(),
        "o2.start": o2.audit_events.get(),
        "inv.start": inv.audit_events.get(),
        "o1.midnight": add_event(o1, MAY_1, actor="olga", action="resume", reason="retry budget"),
        "inv.noon": add_event(inv, MAY_1 + timedelta(hours=12), actor="ivan", action="resume"),
        "o1.last_moment": add_event(o1, MAY_1 + timedelta(days=1, microseconds=-1)),
        "o2.next_midnight": add_event(o2, MAY_1 + timedelta(days=1), actor="olga", action="terminate"),
    }


def ids(trail, *names) -> list[int]:
    return [trail[name].id for name in names]


@pytest.mark.parametrize(
    "params,expected",
    [
        ({}, ["o1.start", "o2.start", "inv.start", "o1.midnight", "inv.noon", "o1.last_moment", "o2.next_midnight"]),
        ({"run": "order:t:o1"}, ["o1.start", "o1.midnight", "o1.last_moment"]),
        ({"since": "2024-05-01"}, ["o1.midnight", "inv.noon", "o1.last_moment", "o2.next_midnight"]),
        ({"until": "2024-05-01"}, ["o1.start", "o2.start", "inv.start"]),
        ({"since": "2024-05-01", "until": "2024-05-02"}, ["o1.midnight", "inv.noon", "o1.last_moment"]),
        ({"since": "2024-05-01T14:00:00+02:00"}, ["inv.noon", "o1.last_moment", "o2.next_midnight"]),
        ({"since": "2024-05-01T12:00:00"}, ["inv.noon", "o1.last_moment", "o2.next_midnight"]),  # naive = UTC
        ({"until": "2024-05-01T12:00:00.000001Z"}, ["o1.start", "o2.start", "inv.start", "o1.midnight", "inv.noon"]),
        ({"workflow": "invoice"}, ["inv.start", "inv.noon"]),
        ({"actor": "olga"}, ["o1.midnight", "o2.next_midnight"]),
        ({"action": "resume"}, ["o1.midnight", "inv.noon"]),
        ({"workflow": "test_orders", "actor": "olga", "action": "resume", "since": "2024-05-01"}, ["o1.midnight"]),
        ({"run": "order:t:o2", "actor": "olga", "until": "2024-05-02"}, []),
        ({"run": "order:t:o2", "since": "2024-05-02", "action": "terminate"}, ["o2.next_midnight"]),
        ({"workflow": "nope", "run": "", "actor": ""}, []),  # empty values are no filter; unknown names match nothing
    ],
)
def test_each_filter_and_their_combination_select_exactly_the_matching_events(trail, params, expected):
    """`since` is inclusive, `until` exclusive, a date is midnight UTC."""
    assert exported_ids(**params) == ids(trail, *expected)


def test_a_date_means_midnight_utc_and_offsets_are_converted_to_utc():
    filters = parse_filters({"since": "2024-05-01", "until": "2024-05-01T12:30:00+02:00", "format": "JSONL"})
    assert filters == AuditFilters(format="jsonl", since=MAY_1, until=MAY_1 + timedelta(hours=10, minutes=30))
    assert filters.since.tzinfo is UTC and filters.until.tzinfo is UTC


@pytest.mark.parametrize(
    "params,message",
    [
        ({"since": "yesterday"}, "since: 'yesterday' is not an ISO 8601 date or datetime"),
        ({"until": "2024-13-01"}, "until: '2024-13-01' is not an ISO 8601 date or datetime"),
        ({"since": "2024-05-01T12:00:00 02:00"}, "%2B"),  # a '+' that a URL turned into a space
        ({"until": "9999-12-31T23:00:00-02:00"}, "until: '9999-12-31T23:00:00-02:00' is out of range"),
        ({"since": "2024-05-02", "until": "2024-05-01"}, "must be earlier than until"),
        ({"since": "2024-05-01", "until": "2024-05-01T00:00:00Z"}, "must be earlier than until"),
        ({"format": "xlsx"}, "unknown format 'xlsx' (expected one of: csv, jsonl)"),
        ({"run": "order:x:nope"}, "no run 'order:x:nope'"),
    ],
)
def test_bad_parameters_are_a_one_line_value_error(params, message):
    with pytest.raises(ValueError) as excinfo:
        parse_filters(params)
    assert message in str(excinfo.value) and "\n" not in str(excinfo.value)


# --- the view -------------------------------------------------------------------------


def test_the_url_is_the_console_audit_export():
    assert reverse("console:audit-export") == URL


def test_anonymous_users_are_sent_to_the_login_page(client):
    response = client.get(URL, {"format": "jsonl"})
    assert response.status_code == 302
    assert response.url == "/login/?next=/audit/export%3Fformat%3Djsonl"


def test_a_user_without_a_console_role_is_forbidden(client):
    client.force_login(user_in(None))
    response = client.get(URL)
    assert response.status_code == 403
    assert response["Content-Type"] == "text/plain; charset=utf-8"
    assert not response.streaming


@pytest.mark.parametrize("group", ["viewer", "operator", "supervisor"])
def test_every_console_role_may_export_and_gets_a_streamed_csv_attachment(client, clock, group):
    run = drive(start(), clock)
    client.force_login(user_in(group))
    clock.set(datetime(2031, 2, 3, 4, 5, 6, tzinfo=UTC))

    response = client.get(URL)

    assert response.status_code == 200 and response.streaming
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert response["Content-Disposition"] == 'attachment; filename="audit-all-20310203T040506Z.csv"'
    assert "no-store" in response["Cache-Control"]
    header, *rows = csv_rows(events_of(b"".join(response.streaming_content).decode()))
    assert header == list(COLUMNS)
    assert [int(r[9]) for r in rows] == list(run.audit_events.order_by("at", "id").values_list("id", flat=True))


def test_a_filtered_jsonl_export_is_named_after_the_run(client, clock):
    run = drive(start(), clock)
    client.force_login(user_in("viewer"))

    response = client.get(URL, {"format": "jsonl", "run": run.workflow_id, "action": "start"})

    assert response["Content-Type"] == "application/x-ndjson"
    assert re.fullmatch(r'attachment; filename="audit-order_t_o1-\d{8}T\d{6}Z\.jsonl"', response["Content-Disposition"])
    [line] = events_of(b"".join(response.streaming_content).decode()).splitlines()
    assert json.loads(line)["action"] == "start"


def test_under_asgi_the_export_streams_asynchronously_with_the_same_content(client, async_client, trail):
    """An ASGI server reads a synchronous iterator whole before sending it: the view gives it
    an asynchronous one."""
    for c in (client, async_client):
        c.force_login(user_in("viewer", username=f"vera-{id(c)}"))
    served = b"".join(client.get(URL, {"format": "jsonl"}).streaming_content)

    async def fetch() -> bytes:
        response = await async_client.get(URL, {"format": "jsonl"})
        assert response.status_code == 200 and response.is_async
        return b"".join([part async for part in response.streaming_content])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert async_to_sync(fetch)() == served
    assert len(events_of(served.decode()).splitlines()) == len(trail)


def test_the_filename_scope_keeps_only_safe_characters():
    filters = AuditFilters(run='inv:t/../"x y";\r\n')
    assert exports.export_filename(filters, now=MAY_1) == "audit-inv_t_..__x_y____-20240501T000000Z.csv"
    assert exports.export_filename(AuditFilters(format="jsonl"), now=MAY_1) == "audit-all-20240501T000000Z.jsonl"


@pytest.mark.parametrize(
    "params,message",
    [
        ({"since": "soon"}, "since: 'soon' is not an ISO 8601 date or datetime"),
        ({"format": "xml"}, "unknown format 'xml'"),
        ({"run": "order:x:y"}, "no run 'order:x:y'"),
        ({"since": "2024-05-02", "until": "2024-05-01"}, "must be earlier than until"),
    ],
)
def test_bad_parameters_are_a_400_with_the_one_line_message(client, params, message):
    client.force_login(user_in("viewer"))
    response = client.get(URL, params)
    assert response.status_code == 400 and not response.streaming
    assert response["Content-Type"] == "text/plain; charset=utf-8"
    body = response.content.decode()
    assert message in body and body.count("\n") == 1


def test_only_get_is_allowed(client):
    client.force_login(user_in("supervisor"))
    assert client.post(URL).status_code == 405
    assert client.put(URL).status_code == 405
    client.logout()
    assert client.post(URL).status_code == 405


# --- the command ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_the_command_writes_what_the_view_serves_for_the_same_filters(client, trail, fmt):
    client.force_login(user_in("viewer"))
    params = {"format": fmt, "since": "2024-05-01", "until": "2024-05-02", "workflow": "test_orders"}
    served = b"".join(client.get(URL, params).streaming_content).decode()

    printed = run_cmd(*[arg for name, value in params.items() for arg in (f"--{name}", value)])

    assert printed == served
    assert len(events_of(served).splitlines()) == (3 if fmt == "csv" else 2)  # o1.midnight, o1.last_moment (+ header)
    assert run_cmd("--format", fmt, "--run", "order:t:o1", "--actor", "olga", "--action", "resume") == "".join(
        exports.export_chunks(parse_filters({"format": fmt, "run": "order:t:o1", "actor": "olga", "action": "resume"}))
    )


def test_the_command_writes_the_output_file_only_once_complete(trail, tmp_path):
    target = tmp_path / "audit.csv"

    assert run_cmd("--output", str(target), "--actor", "olga") == f"exported 2 audit events to {target}\n"

    with open(target, encoding="utf-8", newline="") as f:
        assert f.read() == export_text({"actor": "olga"})
    assert [p.name for p in tmp_path.iterdir()] == ["audit.csv"]  # no temporary file left behind


@pytest.mark.parametrize(
    "args,message",
    [
        (["--format", "xml"], "unknown format 'xml'"),
        (["--since", "last week"], "since: 'last week' is not an ISO 8601"),
        (["--since", "2024-05-02", "--until", "2024-05-01"], "must be earlier than until"),
        (["--run", "order:x:y"], "no run 'order:x:y'"),
    ],
)
def test_bad_command_input_is_one_line_and_creates_no_file(tmp_path, args, message):
    start()
    target = tmp_path / "audit.out"
    with pytest.raises(CommandError, match=re.escape(message)) as excinfo:
        run_cmd(*args, "--output", str(target))
    assert "\n" not in str(excinfo.value)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CommandError, match=re.escape(message)):
        assert run_cmd(*args) == ""


def test_an_unwritable_output_is_a_command_error(tmp_path):
    with pytest.raises(CommandError, match="cannot write"):
        run_cmd("--output", str(tmp_path / "missing-dir" / "audit.csv"))


# --- constant memory ------------------------------------------------------------------

MANY = 20_000
MEMORY_BOUND = 20 * 1024 * 1024


def consume(filters: AuditFilters) -> tuple[int, int]:
    """Stream the whole export, keeping nothing: (lines, queries)."""
    lines = 0
    with CaptureQueriesContext(connection) as queries:
        for chunk in exports.export_chunks(filters):
            lines += chunk.count("\n")
    return lines, len(queries)


def test_exporting_many_events_keeps_memory_flat_and_queries_per_batch():
    """Constant memory: the peak while consuming the stream is bounded by one batch (loading
    the same events at once takes several times the bound), and the number of queries grows
    with the number of batches, not of rows."""
    run = start(now=MAY_1 - timedelta(days=1))
    AuditEvent.objects.bulk_create(
        AuditEvent(
            run=run,
            at=MAY_1 + timedelta(milliseconds=i // 3),  # ties across batch boundaries too
            step_name="create_task",
            actor="executor",
            action="step_succeed",
            reason="the receiver answered 201 with the task it created for this approval",
            before={"run": "running", "step": "running", "attempts": i},
            after={"run": "running", "step": "succeeded", "remote_ref": f"task-{i}"},
        )
        for i in range(MANY)
    )
    # The last batch finds nothing or a remainder. On PostgreSQL a batch is two statements: the
    # query for where it ends, then its COPY.
    if connection.vendor == "postgresql":
        batches = 2 * ((MANY + 1) // exports.COPY_BATCH_SIZE + 1)
    else:
        batches = (MANY + 1) // exports.BATCH_SIZE + 1

    tracemalloc.start()
    try:
        csv_result = consume(parse_filters({"format": "csv"}))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert csv_result == (MANY + 4, batches)  # the run's start event, the header, the trailer's two rows
    assert peak < MEMORY_BOUND, f"peak {peak / 2**20:.1f} MiB while streaming {MANY} events"

    assert consume(parse_filters({"format": "jsonl"})) == (MANY + 3, batches)
