"""Durable waits, as a workflow declares them (issue 38): a step that waits for a named event, or
for a time, holding no worker and no lease while it waits.

    @invoice.wait(event="approved", timeout=timedelta(days=3), on_timeout=OnTimeout.review(),
                  schema=Approval)
    def approval(ctx):
        return ctx.event                       # the step's result: the event's validated payload

    @invoice.sleep(until=lambda ctx: ctx.result("read_invoice")["due_date"])
    def until_due(ctx):
        return None

An event is delivered to a run by name with the sender's idempotency key (the event API, the
console, ``manage.py send_event``): it is validated against ``schema`` and kept; the same key
twice is one event; one that comes before the wait is reached is used when it is; one that comes
after the wait ended is recorded and shown, never applied. What happens at the deadline with no
event is declared (``OnTimeout``): the run goes on with a default, or goes to review — never a
silent rejection. The engine side: recovery.engine.transitions.waits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pydantic

EVENT_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_.-")


ROLES = ("operator", "supervisor")  # who may decide (recovery.permissions: a supervisor may too)


@dataclass(frozen=True)
class OnTimeout:
    """What a wait does when its deadline passes with no event: ``proceed(default)`` — the step
    succeeds with ``default`` as its result, said so in the audit trail — or ``review()`` — the
    run stops for an operator, the step failed "no event by the deadline". A tool call waiting for
    its approval may also ``escalate(role, timeout=…)``: it goes on waiting, for ``timeout`` more,
    for a person of ``role`` (the stuck alert fires), then goes to review."""

    action: str
    default: Any = None
    role: str = ""
    timeout: timedelta | None = None

    @classmethod
    def proceed(cls, default: Any) -> OnTimeout:
        return cls("proceed", default)

    @classmethod
    def review(cls) -> OnTimeout:
        return cls("review")

    @classmethod
    def escalate(cls, role: str, *, timeout: timedelta) -> OnTimeout:
        return cls("escalate", role=role, timeout=timeout)

    def __post_init__(self) -> None:
        if self.action not in ("proceed", "review", "escalate"):
            raise ValueError(f"on_timeout: proceed(default), review() or escalate(role), not {self.action!r}")
        if self.action == "escalate":
            if self.role not in ROLES:
                raise ValueError(f"escalate({self.role!r}): to {' or '.join(ROLES)}")
            if self.timeout is None or self.timeout <= timedelta(0):
                raise ValueError("escalate: how long the escalated approval waits (timeout=) is longer than nothing")

    def text(self) -> str:
        """What the console says happens at the deadline."""
        if self.action == "proceed":
            return f"the run goes on with {self.default!r}"
        if self.action == "escalate":
            return f"it goes to {a_role(self.role)} for {_duration(self.timeout)} more, then to review"
        return "the run goes to review"


@dataclass(frozen=True)
class ToolApproval:
    """A tool whose calls (all, or those ``when`` says) wait for a person before anything is sent
    (``Workflow.tool(needs_approval=…)``): a person of ``role`` approves the call, edits its
    arguments (validated by the tool's schema; the guards run again), rejects it (the reason is
    answered to the model as the tool's result) or answers in the tool's place. ``when(arguments,
    ctx)``: the call's validated arguments and its context (the run's input, earlier results)."""

    when: bool | Callable[[dict[str, Any], Any], bool]
    role: str = "supervisor"
    timeout: timedelta = timedelta(days=3)
    on_timeout: OnTimeout = OnTimeout("review")

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"approver={self.role!r}: {' or '.join(ROLES)}")
        if self.timeout <= timedelta(0):
            raise ValueError("approval_timeout: longer than nothing (a person needs time to decide)")
        if self.on_timeout.action == "proceed":
            # a call approved (or refused) by the clock would be a decision nobody made
            raise ValueError("an approval's timeout escalates or goes to review: it never decides by itself")

    def needed(self, arguments: dict[str, Any], ctx: Any) -> bool:
        return bool(self.when(arguments, ctx)) if callable(self.when) else bool(self.when)

    def describe(self) -> str:
        """ "a supervisor approves each call within 3 days; then the run goes to review" """
        which = "each call" if not callable(self.when) else f"calls {_first_doc_line(self.when) or 'its rule picks'}"
        return f"{a_role(self.role)} approves {which} within {_duration(self.timeout)}; then {self.on_timeout.text()}"


def a_role(role: str) -> str:
    """ "an operator", "a supervisor" """
    return f"an {role}" if role[:1] in ("a", "e", "i", "o", "u") else f"a {role}"


def _duration(value: timedelta | None) -> str:
    if value is None:
        return ""
    seconds = int(value.total_seconds())
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            count = seconds // size
            return f"{count} {unit}{'s' if count > 1 else ''}"
    return f"{seconds} seconds"


def _first_doc_line(fn: Callable) -> str:
    return ((getattr(fn, "__doc__", None) or "").strip().splitlines() or [""])[0].rstrip(".")


@dataclass(frozen=True)
class WaitSpec:
    """A wait step's declaration: the event it waits for ("" for a timer), how long from the
    moment it is reached (``timeout``) or until when (``until(ctx)``, a timer's), what happens
    then, and the pydantic model of the event's payload."""

    event: str
    on_timeout: OnTimeout
    timeout: timedelta | None = None
    until: Callable[[Any], datetime] | None = field(default=None, compare=False)
    schema: type[pydantic.BaseModel] | None = None
    # Whether a run waits here at all (None: always); when it says no, the step goes on at once.
    when: Callable[[Any], bool] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.event and not set(self.event) <= EVENT_NAME_CHARS:
            raise ValueError(f"event {self.event!r}: lower-case letters, digits and _ . - only")
        if self.timeout is not None and self.timeout <= timedelta(0):
            raise ValueError("a wait's timeout is longer than nothing")
        if self.timeout is None and self.until is None:
            # Every wait has a time: its run waits until then (never polled), and what happens
            # then is declared — a wait that could last forever would be a silent rejection.
            raise ValueError("a wait needs a timeout (a timer: until= or a duration)")
        if not self.event and self.on_timeout.action == "escalate":
            raise ValueError("a timer has nobody to escalate to: its time comes, and the run goes on")

    @property
    def is_timer(self) -> bool:
        return not self.event

    def deadline(self, ctx: Any, now: datetime) -> datetime:
        """When the wait reached at ``now`` ends with no event (a timer: its time)."""
        if self.until is not None:
            until = self.until(ctx)
            if isinstance(until, str):
                until = datetime.fromisoformat(until)
            if not isinstance(until, datetime) or until.tzinfo is None:
                raise ValueError(f"until= gave {until!r}: an aware datetime (or its ISO text) is needed")
            return until
        assert self.timeout is not None
        return now + self.timeout

    def validate(self, payload: Any) -> dict[str, Any]:
        """The event's payload as the step will see it: a JSON object, validated by ``schema``."""
        if not isinstance(payload, dict):
            raise ValueError("an event's payload is a JSON object")
        if self.schema is None:
            return payload
        return self.schema.model_validate(payload).model_dump(mode="json")

    def describe(self) -> str:
        """ "waits for event 'approved' for 3 days, 0:00:00; then the run goes to review" """
        if self.is_timer:
            return f"sleeps for {self.timeout}" if self.until is None else "sleeps until the time its workflow sets"
        what = f"waits for event {self.event!r}"
        until = f"for {self.timeout}" if self.until is None else "until the time its workflow sets"
        return f"{what} {until}; then {self.on_timeout.text()}"
