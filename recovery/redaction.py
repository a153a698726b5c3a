"""Redaction: what the engine persists or logs never carries a credential (contract rule 6).

    redact({"password": "hunter2", "note": "Authorization: Bearer abc.def.ghi"})
    == {"password": "[REDACTED]", "note": "Authorization: [REDACTED:bearer]"}

``redact(value)`` walks JSON-like data (dicts, lists, tuples, strings; anything else is kept as
it is) and replaces

- the value of every key named like a credential (``RECOVERY_REDACT_FIELDS``, compared
  case-insensitively with ``-`` read as ``_``; a key matches a name exactly or ends with
  ``_`` + the name: ``db_password``, ``X-Api-Key``, ``openai_api_key``, but not
  ``prompt_tokens``) with ``[REDACTED]``;
- every substring of a string that matches one of ``RECOVERY_REDACT_PATTERNS`` (a name → regex
  mapping: our ingestion tokens, ``Bearer …``, OpenAI keys, AWS access key ids, JWTs, private
  key blocks) with ``[REDACTED:<name>]``;
- every occurrence of the value of a setting named in ``RECOVERY_REDACT_SETTINGS`` (the secrets
  this deployment knows: ``SECRET_KEY``, ``OPENAI_API_KEY``, ``SANDBOX_API_KEY``,
  ``RECOVERY_METRICS_TOKEN``, ``RECOVERY_ALERT_WEBHOOK_SECRET``, ``RECOVERY_SMTP_PASSWORD``; values
  shorter than 8 characters are not looked for: they would mangle ordinary text) with
  ``[REDACTED:<SETTING>]``.

A NUL character, which PostgreSQL cannot store, becomes U+FFFD (a remote system's error text
may carry one; the console and the API refuse it in what people type).

Invariants: deterministic (the same input and settings give the same output) and idempotent
(``redact(redact(x)) == redact(x)``), so that a hash taken over redacted data is stable; the
input is never modified, and is returned itself when nothing in it needed redacting. The
configuration is compiled once into one combined regex (again when a test changes a setting),
strings shorter than the shortest possible match are not searched at all, and a short string
already seen (a state, a step's ref) is not searched again (a memo of 10,000 strings of up to
200 characters per configuration): redacting a small checkpoint costs microseconds.

``RedactingFilter`` does the same to log records; ``install_log_redaction`` makes every
record redacted where it is created, whatever handler (console, Celery's, a test's) gets it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

MARKER = "[REDACTED]"
NUL_REPLACEMENT = "\ufffd"  # what a NUL character (U+0000) is stored as

DEFAULT_FIELDS: tuple[str, ...] = (
    "password",
    "passwd",
    "secret",
    "token",
    "api_key",
    "apikey",
    "authorization",
    "access_token",
    "refresh_token",
    "client_secret",
    "private_key",
    "cookie",
    "set_cookie",
    "session_key",
    "credentials",
)

_URLSAFE = r"[A-Za-z0-9_-]"
DEFAULT_PATTERNS: dict[str, str] = {
    # recovery.api.tokens: "rc_" + secrets.token_urlsafe(32) (43 characters)
    "ingestion_token": rf"(?<![A-Za-z0-9])rc_{_URLSAFE}{{40,}}",
    "bearer": r"(?i:\bbearer)\s+[A-Za-z0-9._~+/=-]{8,}",
    "openai_key": rf"(?<![A-Za-z0-9])sk-{_URLSAFE}{{20,}}",
    "aws_access_key": r"(?<![A-Z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])",
    "jwt": rf"\beyJ{_URLSAFE}{{8,}}\.eyJ{_URLSAFE}{{8,}}\.{_URLSAFE}*",
    "private_key": r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)",
}

DEFAULT_SECRET_SETTINGS: tuple[str, ...] = (
    "SECRET_KEY",
    "OPENAI_API_KEY",
    "SANDBOX_API_KEY",
    "RECOVERY_METRICS_TOKEN",
    "RECOVERY_ALERT_WEBHOOK_SECRET",
    "RECOVERY_SMTP_PASSWORD",
    "RECOVERY_EVENT_SIGNING_SECRET",
    "SANDBOX_CALLBACK_SECRET",
)

MIN_SECRET_LENGTH = 8
_CLEAN = "\x00clean"  # a memoised string that needed no redaction (no redacted form holds a NUL)
_MEMO_LENGTH = 200  # longer strings are redacted every time, never kept
_MEMO_ENTRIES = 10_000


@dataclass(frozen=True)
class _Redactor:
    fields: frozenset[str]
    regex: re.Pattern[str] | None
    min_length: int  # strings shorter than this cannot contain a match
    markers: dict[str, str]  # group name -> marker
    keys: dict[str, bool] = field(default_factory=dict, compare=False)  # key name -> sensitive
    # short string -> its redacted form, or _CLEAN: a checkpoint's states and refs recur
    strings: dict[str, str] = field(default_factory=dict, compare=False)

    def string(self, text: str) -> str:
        known = self.strings.get(text)
        if known is not None:
            return text if known is _CLEAN else known
        redacted = self._string(text)
        if len(text) <= _MEMO_LENGTH and len(self.strings) < _MEMO_ENTRIES:
            self.strings[text] = _CLEAN if redacted == text else redacted
        return redacted

    def _string(self, text: str) -> str:
        if "\x00" in text:  # PostgreSQL stores no NUL in text or jsonb: a remote error could carry one
            text = text.replace("\x00", NUL_REPLACEMENT)
        if self.regex is None or len(text) < self.min_length:
            return text
        return self.regex.sub(self._marker, text)

    def _marker(self, match: re.Match[str]) -> str:
        if match.lastgroup == "assigned":  # "password=…": keep the name, replace the value
            return match.group()[: match.end("value") - match.start()] + MARKER
        return self.markers[match.lastgroup or ""]

    def value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.string(value)
        if isinstance(value, dict):
            changed = False
            out = {}
            for key, item in value.items():
                if item is not None and item != "" and self.sensitive(key):
                    new = MARKER
                else:
                    new = self.value(item)
                changed = changed or new is not item
                out[key] = new
            return out if changed else value
        if isinstance(value, (list, tuple)):
            items = [self.value(item) for item in value]
            if all(new is old for new, old in zip(items, value, strict=True)):
                return value
            return type(value)(items) if isinstance(value, tuple) else items
        return value

    def sensitive(self, key: Any) -> bool:
        if not isinstance(key, str):
            return False
        known = self.keys.get(key)
        if known is None:
            parts = key.lower().replace("-", "_").split("_")
            known = any("_".join(parts[i:]) in self.fields for i in range(len(parts)))
            if len(self.keys) < 10_000:
                self.keys[key] = known
        return known


def _min_width(pattern: str) -> int:
    try:
        return re._parser.parse(pattern).getwidth()[0]  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a private helper; without it every string is searched
        return 1


@lru_cache(maxsize=64)
def _redactor(extra_fields: frozenset[str] = frozenset()) -> _Redactor:
    fields = getattr(settings, "RECOVERY_REDACT_FIELDS", DEFAULT_FIELDS)
    patterns = getattr(settings, "RECOVERY_REDACT_PATTERNS", DEFAULT_PATTERNS)
    secret_settings = getattr(settings, "RECOVERY_REDACT_SETTINGS", DEFAULT_SECRET_SETTINGS)
    alternatives: list[tuple[str, str, str, int]] = []  # (group, regex, marker, min width)
    secrets = {}
    for name in secret_settings:
        value = getattr(settings, name, "") or ""
        if isinstance(value, str) and len(value) >= MIN_SECRET_LENGTH:
            secrets.setdefault(value, name)
    # Exact secrets first, the longest first: a secret that contains another is replaced whole.
    for i, (value, name) in enumerate(sorted(secrets.items(), key=lambda item: (-len(item[0]), item[0]))):
        alternatives.append((f"s{i}", re.escape(value), f"[REDACTED:{name}]", len(value)))
    for i, (name, regex) in enumerate(patterns.items()):
        re.compile(regex)  # a bad pattern fails here, naming itself in the traceback
        alternatives.append((f"p{i}", regex, f"[REDACTED:{name}]", _min_width(regex)))
    all_fields = sorted({f.lower().replace("-", "_") for f in (*fields, *extra_fields)}, key=lambda f: (-len(f), f))
    if all_fields:
        # A credential field written out in text: "password=…", "?api_key=…", '"token": "…"',
        # "X-Api-Key: …", "Authorization: Bearer …" (the scheme is kept with the name).
        names = "|".join(re.escape(f).replace("_", "[_-]") for f in all_fields)
        initials = re.escape("".join(sorted({c for f in all_fields for c in (f[0].lower(), f[0].upper())})))
        assigned = (  # the look-ahead on the initials first: most positions are rejected at once
            rf"(?=[{initials}])(?i:(?:(?<![A-Za-z0-9])|(?<=[_-]))(?:{names})[\"']?\s*[:=]\s*[\"']?"
            rf"(?:(?:bearer|basic|token)\s+)?)(?P<value>)[^\s\"'&,;]+"
        )
        alternatives.append(("assigned", assigned, MARKER, 1 + min(len(f) for f in all_fields) + 1))
    regex = None
    if alternatives:
        regex = re.compile("|".join(f"(?P<{group}>{body})" for group, body, _, _ in alternatives))
    return _Redactor(
        fields=frozenset(f.lower().replace("-", "_") for f in (*fields, *extra_fields)),
        regex=regex,
        min_length=max(1, min((width for *_, width in alternatives), default=1)),
        markers={group: marker for group, _, marker, _ in alternatives},
    )


@receiver(setting_changed)
def _settings_changed(*, setting: str, **kwargs: Any) -> None:
    if setting.startswith("RECOVERY_REDACT") or setting in _secret_setting_names():
        _redactor.cache_clear()


def _secret_setting_names() -> Iterable[str]:
    return getattr(settings, "RECOVERY_REDACT_SETTINGS", DEFAULT_SECRET_SETTINGS)


def redact(value: Any, *, fields: Iterable[str] = ()) -> Any:
    """``value`` with every credential replaced by a marker (see the module docstring);
    ``fields`` adds key names to ``RECOVERY_REDACT_FIELDS`` (a workflow's own)."""
    return _redactor(frozenset(fields)).value(value)


def redact_text(text: str) -> str:
    """A string with every pattern and known secret replaced (no field names: it has no keys)."""
    return _redactor().string(text)


def is_sensitive_field(name: str, *, fields: Iterable[str] = ()) -> bool:
    return _redactor(frozenset(fields)).sensitive(name)


# --- logs ---------------------------------------------------------------------------------


class RedactingFilter(logging.Filter):
    """Redacts a log record in place: its message with its arguments (formatted, then
    redacted), and its traceback, kept as redacted text only (``exc_info`` is dropped, so
    that no handler renders the exception, or its frames' locals, itself). Never drops a
    record. Attach it to handlers: a logger's own filters do not see its children's records."""

    def filter(self, record: logging.LogRecord) -> bool:
        _redact_record(record)
        return True


_formatter = logging.Formatter()


def _redact_record(record: logging.LogRecord) -> logging.LogRecord:
    if getattr(record, "redacted", False):
        return record
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a bad format string: logging reports it when it formats
        return record
    record.msg, record.args = redact_text(message), ()
    if record.exc_info:
        if not record.exc_text:
            record.exc_text = _formatter.formatException(record.exc_info)
        record.exc_info = None
    if record.exc_text:
        record.exc_text = redact_text(record.exc_text)
    if record.stack_info:
        record.stack_info = redact_text(record.stack_info)
    record.redacted = True
    return record


_installed = False


def install_log_redaction() -> None:
    """Redact every log record where it is created (a record factory), so that no handler
    — ours, Django's, Celery's, a test's — ever gets a credential. Idempotent."""
    global _installed
    if _installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        return _redact_record(previous(*args, **kwargs))

    logging.setLogRecordFactory(factory)
    _installed = True
