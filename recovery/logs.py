"""Logs a machine can query: the run, step and actor a record is about, and one JSON object
per line when ``RECOVERY_LOG_FORMAT=json``.

Code that works on a run binds what it works on (``bound``); ``ContextFilter``, on the handler,
copies those fields onto every record logged meanwhile, so that a record from deep inside a
call (an adapter's warning, the heartbeat's) still says which run and step it is about. A field
given to the record itself (``extra=``) wins over the bound one.

``JsonFormatter`` (python-json-logger) writes ``time``, ``level``, ``logger``, ``message`` and
every field below that is set; its values are redacted like everything else the engine writes
(recovery.redaction), after the handler's RedactingFilter has redacted the message."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter as _JsonFormatter

from recovery import redaction

# What an engine record carries, when it is known: the run (its id, its workflow's name, the
# executor's lease generation), the step (its name, its attempts so far, its idempotency key's
# first characters: enough to find the request in a receiver's logs, not to replay it), who acts
# ("executor", an operator's username, "api:<token name>"), and the transition's action.
FIELDS = ("workflow_id", "workflow", "step", "attempt", "key", "lease_generation", "actor", "action")
KEY_PREFIX = 16

_bound: ContextVar[dict[str, Any]] = ContextVar("recovery_log_fields", default={})  # noqa: B039 - never mutated


@contextmanager
def bound(**fields: Any) -> Iterator[None]:
    """Every record logged in this block (in this thread or task) carries ``fields`` (None: not set)."""
    token = _bound.set({**_bound.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _bound.reset(token)


def key_prefix(key: str) -> str:
    return key[:KEY_PREFIX]


class ContextFilter(logging.Filter):
    """Copies the bound fields onto each record (on the handler, like RedactingFilter)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in _bound.get().items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


class JsonFormatter(_JsonFormatter):
    """One JSON object per line: time, level, logger, message, the engine's fields, a traceback."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("fmt", "%(asctime)s %(levelname)s %(name)s %(message)s")
        kwargs.setdefault("rename_fields", {"asctime": "time", "levelname": "level", "name": "logger"})
        kwargs.setdefault("reserved_attrs", [*RESERVED_ATTRS, "redacted"])  # RedactingFilter's mark
        super().__init__(*args, **kwargs)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's name
        return datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        return redaction.redact(log_data)
