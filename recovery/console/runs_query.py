"""The runs list: its filters as the URL carries them, the query behind them (searched by
branches, each with its own index) and its keyset pagination."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.db.models import Q, Value
from django.db.models.functions import StrIndex, Upper

from recovery import counts, registry
from recovery.counts import STUCK_LABELS, stuck_causes
from recovery.models import RunSearch, RunState, StepExecution, WorkflowRun

PAGE_SIZE = 50

# The columns the list sorts by, and the field each sorts on. "created" is the run id: ids are
# given in the order runs are created (each stamped created_at then), and the id's index serves it.
SORTS = {"created": "pk", "updated": "updated_at", "state": "state", "workflow": "workflow_id"}
UNIQUE_SORTS = {"pk", "workflow_id"}  # no tie-breaker needed
NEWEST_FIRST = {"created", "updated"}  # a first click on these sorts newest first
DEFAULT_SORT = "-created"

AGES = {"1h": timedelta(hours=1), "24h": timedelta(hours=24), "7d": timedelta(days=7), "30d": timedelta(days=30)}


@dataclass(frozen=True)
class RunFilters:
    """The runs list's filters, as the URL carries them (a shared link shows the same list)."""

    state: str = ""
    workflow: str = ""
    version: int | None = None  # the workflow version the runs execute on (of any workflow, unless one is chosen)
    stuck: str = ""  # a cause from STUCK_LABELS, or "any"
    q: str = ""  # a part of a workflow id, business key or remote reference; the beginning of a key
    key: str = ""  # the beginning of a business key ("acme:INV-1002") or of a workflow id, any case
    age: str = ""  # created more than this long ago (AGES)
    sort: str = ""  # a column of SORTS, "-" before it for descending; "" is "-created" (newest first)
    after: int | None = None  # keyset cursor: the last run id of the previous page
    mark: str = ""  # and that run's value of the sorted column (but for "created": its id is its order)

    @classmethod
    def from_params(cls, params) -> RunFilters:
        def text(name: str, limit: int = 255) -> str:
            return (params.get(name) or "").strip()[:limit]

        state = text("state")
        stuck = text("stuck")
        age = text("age")
        after = _cursor(text("after"))
        sort = text("sort", 20)
        sort = "" if sort == DEFAULT_SORT or sort.lstrip("-") not in SORTS else sort
        mark = text("mark")
        if after is not None and _mark_value(sort, mark) is None:
            after, mark = None, ""  # a cursor without its sorted value: the first page
        return cls(
            state=state if state in counts.list_states() else "",
            workflow=text("workflow", 100),
            version=_version(text("version", 20)),
            stuck=stuck if stuck in STUCK_LABELS or stuck == "any" else "",
            q=text("q"),
            key=text("key"),
            age=age if age in AGES else "",
            sort=sort,
            after=after,
            mark=mark if after is not None and SORTS[(sort or DEFAULT_SORT).lstrip("-")] != "pk" else "",
        )

    def query(self, **changes: Any) -> str:
        """This filter set as a query string, with ``changes`` applied (the cursor is reset
        unless given)."""
        values = {**asdict(self), "after": None, "mark": "", **changes}
        return urlencode({k: v for k, v in values.items() if v not in ("", None)})

    def describe(self) -> str:
        """The filters other than the search, in words ("that are failed, of invoice, older
        than 24h"), for a page that found nothing; "" when there are none."""
        parts = []
        if self.state:
            parts.append(f"that are {counts.list_states()[self.state].lower()}")
        if self.stuck:
            parts.append("stuck" if self.stuck == "any" else f"stuck: {STUCK_LABELS[self.stuck].lower()}")
        if self.workflow:
            parts.append(f"of {self.workflow}" + (f" v{self.version}" if self.version is not None else ""))
        elif self.version is not None:
            parts.append(f"on version {self.version}")
        if self.key:
            parts.append(f"whose business key begins {self.key}")
        if self.age:
            parts.append(f"older than {self.age}")
        if self.after is not None:
            parts.append("on this page")
        return ", ".join(parts)

    def query_items(self) -> list[tuple[str, str]]:
        """The filters (without the cursor) as form fields, so a POST keeps them."""
        return [(k, str(v)) for k, v in asdict(self).items() if v not in ("", None) and k not in ("after", "mark")]

    @property
    def filtered(self) -> bool:
        """Whether any filter or a search narrows the list (the cursor and the order do not)."""
        return any(v not in ("", None) for k, v in asdict(self).items() if k not in ("sort", "after", "mark"))

    @property
    def order(self) -> tuple[str, bool]:
        """The sorted column (a key of SORTS) and whether it is descending."""
        sort = self.sort or DEFAULT_SORT
        return sort.lstrip("-"), sort.startswith("-")

    def ordering(self) -> list[str]:
        """``order_by``'s fields: the sorted column, then the run id in the same direction (the
        tie-breaker; an index on (state, id) serves the state's order both ways)."""
        column, descending = self.order
        sign = "-" if descending else ""
        field = SORTS[column]
        return [sign + field] if field in UNIQUE_SORTS else [sign + field, sign + "pk"]

    def cursor_of(self, run: WorkflowRun) -> dict[str, Any]:
        """The cursor of the page after ``run`` (the last of a page), as ``query`` takes it."""
        column, _ = self.order
        field = SORTS[column]
        if field == "pk":
            return {"after": run.pk}
        value = getattr(run, field)
        return {"after": run.pk, "mark": value.isoformat() if isinstance(value, datetime) else str(value)}

    def headers(self) -> dict[str, dict[str, str]]:
        """Per sortable column, the link that sorts by it (the other direction when it is the sorted
        one; else its natural one: newest first for times, A to Z for text) and its aria-sort."""
        column, descending = self.order
        found = {}
        for name in SORTS:
            if name == column:
                sort, aria = (name if descending else f"-{name}"), ("descending" if descending else "ascending")
            else:
                sort, aria = (f"-{name}" if name in NEWEST_FIRST else name), "none"
            found[name] = {"query": self.query(sort="" if sort == DEFAULT_SORT else sort), "aria": aria}
        return found

    def _after_cursor(self) -> Q:
        """The runs after the cursor in the list's order (keyset: the sorted value, then the id)."""
        column, descending = self.order
        field, op = SORTS[column], ("lt" if descending else "gt")
        if field == "pk":
            return Q(**{f"pk__{op}": self.after})
        value = _mark_value(self.sort, self.mark)
        if field in UNIQUE_SORTS:
            return Q(**{f"{field}__{op}": value})
        return Q(**{f"{field}__{op}": value}) | Q(**{field: value, f"pk__{op}": self.after})

    def _narrowed(self, now: datetime, *, paged: bool = False):
        """The runs matching every filter but the search (``q``); ``paged``: after the cursor."""
        qs = WorkflowRun.objects.all()
        if self.state:
            qs = qs.filter(counts.state_filter(self.state))
        if self.workflow:
            qs = qs.filter(workflow_name=self.workflow)
        if self.version is not None:
            qs = qs.filter(workflow_version=self.version)
        if self.key:
            qs = qs.filter(pk__in=by_business_key(self.key).values("run_id"))
        if self.age:
            qs = qs.filter(created_at__lte=now - AGES[self.age])
        if self.stuck:
            causes = stuck_causes(now)
            if self.stuck == "any":
                cond = Q()
                for _, q in causes.values():
                    cond |= q
                qs = qs.filter(cond)
            else:
                qs = qs.filter(causes[self.stuck][1])
        if paged and self.after is not None:
            qs = qs.filter(self._after_cursor())
        return qs

    def _search_branches(self, qs) -> list:
        """``qs`` narrowed to each way a run matches the search, case-insensitively: ``q`` is in
        its workflow id (and so its business key), or in one of its steps' remote references or
        compensation references, or begins one of its steps' idempotency keys (the workflow id is
        searched in RunSearch, written once per run). Kept apart (never OR-ed in one WHERE with
        the runs): each branch has its own index (pg_trgm on PostgreSQL, migration 0019),
        whereas the OR makes the database walk every run newest first looking for the few that
        match."""
        q = self.q
        # "<> ''" lets PostgreSQL use the partial indexes (a step with no reference has no entry).
        by_ref = (
            Q(idempotency_key=q)
            | (Q(remote_ref__icontains=q) & ~Q(remote_ref=""))
            | (Q(compensation_ref__icontains=q) & ~Q(compensation_ref=""))
        )
        key = q.lower()
        if _HEX.fullmatch(key):
            # Keys are lowercase hex: those beginning with ``key`` lie in [key, key + "g"), a
            # range of the keys' unique index.
            by_ref |= Q(idempotency_key__gte=key, idempotency_key__lt=key + "g")
        by_step = StepExecution.objects.filter(by_ref).values("run_id")
        by_id = RunSearch.objects.filter(workflow_id__icontains=_distinctive(q))
        if _distinctive(q) != q:  # the index finds the candidates, the whole text decides
            by_id = by_id.alias(at=StrIndex(Upper("workflow_id"), Upper(Value(q)))).filter(at__gt=0)
        branches = [qs.filter(pk__in=by_id.values("run_id")), qs.filter(pk__in=by_step)]
        if len(q) >= ERROR_SEARCH_LENGTH:
            # A step's error text ("HTTP 503", "forbidden"): only the steps that hold one, and
            # only for a text long enough to be selective. No index (the steps' indexes are
            # written by every checkpoint): on PostgreSQL the steps with an error are read.
            by_error = StepExecution.objects.filter(last_error__icontains=q).exclude(last_error="")
            branches.append(qs.filter(pk__in=by_error.values("run_id")))
        return branches

    def queryset(self, now: datetime):
        """Every matching run, unordered and unlimited (for a page or a bulk action, use
        ``newest``)."""
        qs = self._narrowed(now)
        if not self.q:
            return qs
        branches = [branch.values("pk") for branch in self._search_branches(qs)]
        return WorkflowRun.objects.filter(pk__in=branches[0].union(*branches[1:]))

    def newest(self, now: datetime, *, limit: int, paged: bool = False):
        """The first ``limit`` matching runs in the list's order (newest first unless sorted),
        after the cursor when ``paged``, as a sliced queryset (``.only()`` and ``.values_list()``
        still apply).

        A search is the union of its branches, each cut to its own ``limit`` newest (the
        ``limit`` first of a union are among the ``limit`` first of each part): one query,
        in which every branch reads at most ``limit`` rows from its own index. A branch's
        slice is wrapped in ``pk__in`` because SQLite refuses LIMIT in the arms of a UNION."""
        qs = self._narrowed(now, paged=paged)
        ordering = self.ordering()
        if not self.q:
            return qs.order_by(*ordering)[:limit]
        limited = [
            WorkflowRun.objects.filter(pk__in=branch.order_by(*ordering).values("pk")[:limit]).values("pk")
            for branch in self._search_branches(qs)
        ]
        return WorkflowRun.objects.filter(pk__in=limited[0].union(*limited[1:])).order_by(*ordering)[:limit]


def by_business_key(key: str):
    """The runs (as RunSearch rows) whose business key begins with ``key``, as the run page shows
    it ("acme:INV-1002" of "invoice:acme:INV-1002"), or whose workflow id does: in any case.
    On PostgreSQL both are LIKE patterns on UPPER(workflow_id), which the trigram index of
    RunSearch serves (migration 0019); the business key's is then checked to begin right after
    the workflow's name (the first ':'), so "acme" does not find "invoice:globex:acme-1"."""
    after_name = StrIndex(Upper("workflow_id"), Upper(Value(":" + key))) - StrIndex("workflow_id", Value(":"))
    return RunSearch.objects.alias(gap=after_name).filter(
        Q(workflow_id__istartswith=key) | Q(workflow_id__icontains=":" + key, gap=0)
    )


_HEX = re.compile(r"[0-9a-f]{1,64}")
_WORD = re.compile(r"[^\W_]+")
DISTINCTIVE_LENGTH = 12
ERROR_SEARCH_LENGTH = 3  # a shorter search text does not look in the steps' error text


def _distinctive(q: str) -> str:
    """The part of a long search text the trigram index looks up: of its words that hold a
    digit (the numbers in ids), the one with the most digits, the last of equals, at most
    DISTINCTIVE_LENGTH characters of its end; else the whole text. Every trigram of a pattern
    is a posting list the index must read, and the workflow name and tenant that begin every
    workflow id ("invoice:acme-…") are in a large share of the runs: at a million runs,
    "invoice:wayne-logistics:INV-2024-0050000" read 5,700 index pages, "0050000" 500. A run
    whose id holds the whole text holds this part too; the whole text is checked after."""
    if len(q) <= DISTINCTIVE_LENGTH:
        return q
    numbered = [w for w in _WORD.findall(q) if len(w) >= 3 and any(c.isdigit() for c in w)]
    if not numbered:
        return q
    best = max(reversed(numbered), key=lambda w: sum(c.isdigit() for c in w))
    return best[-DISTINCTIVE_LENGTH:]


MAX_CURSOR = 2**63 - 1  # a run id is a 64-bit integer


def _cursor(value: str) -> int | None:
    """A keyset cursor from the URL: a run id in ASCII digits (``str.isdigit`` also accepts
    "²" or "١", which ``int`` refuses or reads), within the 64-bit range of the ids; anything
    else means the first page."""
    if not (value.isascii() and value.isdigit()):
        return None
    cursor = int(value)
    return cursor if cursor <= MAX_CURSOR else None


def _mark_value(sort: str, mark: str) -> Any:
    """The sorted value of a cursor from the URL, as the database compares it; None when it is
    not one the column can hold (the cursor is then dropped: the first page). The run id's order
    needs none ("")."""
    field = SORTS[(sort or DEFAULT_SORT).lstrip("-")]
    if field == "pk":
        return ""
    if field == "updated_at":
        try:  # in UTC, as stored: a time at the ends of the calendar may not have one
            value = datetime.fromisoformat(mark)
            return value.astimezone(UTC) if value.tzinfo is not None else None
        except (ValueError, OverflowError):
            return None
    if field == "state":
        return mark if mark in RunState.values else None
    return mark or None


def _version(value: str) -> int | None:
    """A workflow version from the URL ("2", or "v2" as the console writes it): up to 9 ASCII
    digits; anything else means no version filter, as a bad state or age does."""
    return registry.version_number(value.removeprefix("v"))


RUN_LIST_FIELDS = (
    "pk",
    "workflow_id",
    "workflow_name",
    "workflow_version",
    "state",
    "current_step",
    "status_reason",
    "created_at",
    "updated_at",
    "lease_owner",
    "lease_expires_at",
    "next_wake_at",
    "reserved_for",
    "reserved_until",
    # the why-sentence of a run whose pause was asked names who, when and why (recovery.why)
    "paused_at",
    "paused_by",
    "pause_reason",
    "workflow_pause_id",  # held by its workflow's pause: released with it
)


def runs_page(filters: RunFilters, *, now: datetime) -> tuple[list[WorkflowRun], int | None]:
    """One page of runs in the list's order (newest first unless sorted), by keyset (after the
    cursor's sorted value and id): as fast on page 500 as on page 1. Returns the runs and the
    cursor of the next page (None on the last page; ``filters.cursor_of`` gives its query)."""
    rows = list(filters.newest(now, limit=PAGE_SIZE + 1, paged=True).only(*RUN_LIST_FIELDS))
    return rows[:PAGE_SIZE], (rows[PAGE_SIZE - 1].pk if len(rows) > PAGE_SIZE else None)


def total(filters: RunFilters, *, now: datetime) -> str:
    """How many runs match the filters (every page of them), as the list's header says it:
    "1,234 runs", "10,000+ runs", "1 run matches the filters" (counts.capped_counts: one query
    reading at most COUNT_CAP + 1 rows, however many match)."""
    (n, capped), *_ = counts.capped_counts([filters.queryset(now)])
    one = n == 1 and not capped
    found = f"{n:,}{'+' if capped else ''} run{'' if one else 's'}"
    return f"{found} {'matches' if one else 'match'} the filters" if filters.filtered else found
