"""Login throttling, three limits, each refusing a login (even with the right password) until
enough of its failures have left its window:

- per user: RECOVERY_LOGIN_MAX_FAILURES failed logins for one username in the last
  RECOVERY_LOGIN_LOCKOUT_SECONDS (a guesser on one account);
- per address: RECOVERY_LOGIN_MAX_FAILURES_PER_ADDRESS failures from one client address, across
  usernames, in the same window (one client spraying many accounts);
- global: RECOVERY_LOGIN_MAX_FAILURES_GLOBAL failures across the console in the last
  RECOVERY_LOGIN_GLOBAL_WINDOW_SECONDS (a spray from many addresses). A high ceiling in a short
  window: it caps the guesses a distributed spray gets, and an operator refused meanwhile may try
  again within that window — never a lock that an attacker can keep shut for long.

Failures are rows in the engine's database (``LoginFailure``), so every web process sees the same
count. Each attempt is admitted under a lock per username (a PostgreSQL advisory lock; SQLite's
transactions already take the one write lock at BEGIN): the limits are checked and the attempt
is counted as a failure before the password is checked, and a right password then clears the
username's failures. So a parallel burst of guesses at one username checks at most the limit's
number of passwords. Attempts refused by a limit are not counted (a lock ends on time however
hard someone knocks) and never check the password. A limit names no username: the same answer
comes for a username that exists and one that does not.

The client's address is REMOTE_ADDR, or what a trusted proxy wrote (``client_address``).
The check sits in the authentication backend, so it holds for every login form (the console's
and the admin's); the console's login view only explains it (recovery.console.auth_views)."""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.backends import ModelBackend, UserModel
from django.db import connection, transaction
from django.http import HttpRequest

from recovery import clock
from recovery.models import LoginFailure

USERNAME_LENGTH = LoginFailure._meta.get_field("username").max_length
# The first key of PostgreSQL's two-key advisory locks: the login throttle's own namespace.
ADVISORY_NAMESPACE = 0x4C4F47  # "LOG"
# Where a refusal is left on the request for the login view to explain.
REFUSAL_ATTRIBUTE = "_recovery_login_refusal"


@dataclass(frozen=True)
class Refusal:
    """Which limit refused a login and when it lets the next attempt through."""

    limit: str  # "user", "address" or "global"
    until: datetime


def normalise(username: str) -> str:
    """One key for "Alice", " alice" and "ALICE", so that case does not buy more attempts."""
    return username.strip().casefold()[:USERNAME_LENGTH]


def client_address(request: HttpRequest | None) -> str:
    """The client's IP address: REMOTE_ADDR; behind RECOVERY_TRUSTED_PROXY_HEADER, the entry
    RECOVERY_TRUSTED_PROXY_COUNT places from the right of that header (what the outermost of
    our proxies saw), when it is an IP address. Never a header nobody configured: a client
    writes any X-Forwarded-For it likes."""
    if request is None:
        return ""
    meta = request.META
    header = settings.RECOVERY_TRUSTED_PROXY_HEADER
    if header and meta.get(header):
        entries = [e.strip() for e in str(meta[header]).split(",") if e.strip()]
        count = settings.RECOVERY_TRUSTED_PROXY_COUNT
        if len(entries) >= count:
            candidate = _ip(entries[-count])
            if candidate:
                return candidate
    return _ip(str(meta.get("REMOTE_ADDR", "")))


def _ip(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text.strip()))
    except ValueError:
        return ""


def _windows(now: datetime) -> tuple[datetime, datetime]:
    return (
        now - timedelta(seconds=settings.RECOVERY_LOGIN_LOCKOUT_SECONDS),
        now - timedelta(seconds=settings.RECOVERY_LOGIN_GLOBAL_WINDOW_SECONDS),
    )


def _opens(rows, limit: int, seconds: float) -> datetime | None:
    """When the oldest of the last ``limit`` failures (newest first) leaves the window, if there are that many."""
    if limit <= 0:  # the limit is off
        return None
    recent = list(rows.order_by("-at").values_list("at", flat=True)[:limit])
    if len(recent) < limit:
        return None
    return recent[-1] + timedelta(seconds=seconds)


def refusal(username: str, address: str = "", *, now: datetime | None = None) -> Refusal | None:
    """The limit that refuses a login by ``username`` from ``address`` now, or None."""
    now = now or clock.now()
    window, global_window = _windows(now)
    lockout = settings.RECOVERY_LOGIN_LOCKOUT_SECONDS
    checks = [
        ("user", LoginFailure.objects.filter(username=normalise(username), at__gt=window),
         settings.RECOVERY_LOGIN_MAX_FAILURES, lockout),
        ("address", LoginFailure.objects.filter(address=address, at__gt=window),
         settings.RECOVERY_LOGIN_MAX_FAILURES_PER_ADDRESS if address else 0, lockout),
        ("global", LoginFailure.objects.filter(at__gt=global_window),
         settings.RECOVERY_LOGIN_MAX_FAILURES_GLOBAL, settings.RECOVERY_LOGIN_GLOBAL_WINDOW_SECONDS),
    ]  # fmt: skip
    for limit, rows, most, seconds in checks:
        until = _opens(rows, most, seconds)
        if until is not None:
            return Refusal(limit, until)
    return None


def locked_until(username: str, *, now: datetime | None = None) -> datetime | None:
    """When ``username`` may try again by the per-user limit, or None if it may now."""
    found = refusal(username, now=now)
    return found.until if found is not None and found.limit == "user" else None


def _lock(username: str) -> None:
    """Hold the username's lock until the transaction ends (PostgreSQL; on SQLite the
    transaction itself holds the database's write lock from BEGIN)."""
    if connection.vendor == "postgresql":
        key = int.from_bytes(hashlib.blake2b(username.encode(), digest_size=4).digest(), "big", signed=True)
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [ADVISORY_NAMESPACE, key])


def admit(username: str, address: str = "", *, now: datetime | None = None) -> Refusal | None:
    """Admit one login attempt: refused by a limit (returned, nothing counted), or counted as a
    failure now — before its password is checked, so that parallel attempts cannot all pass
    one check — to be cleared by ``reset`` if the password is right. Forgets failures that
    have left every window."""
    now = now or clock.now()
    key = normalise(username)
    with transaction.atomic():
        _lock(key)
        refused = refusal(key, address, now=now)
        if refused is not None:
            return refused
        LoginFailure.objects.filter(at__lte=min(_windows(now))).delete()
        LoginFailure.objects.create(username=key, address=address, at=now)
    return None


def record_failure(username: str, address: str = "", *, now: datetime | None = None) -> None:
    """Count one failed login, and forget every failure that has left every window."""
    now = now or clock.now()
    with transaction.atomic():
        LoginFailure.objects.filter(at__lte=min(_windows(now))).delete()
        LoginFailure.objects.create(username=normalise(username), address=address, at=now)


def reset(username: str) -> None:
    LoginFailure.objects.filter(username=normalise(username)).delete()


class ThrottledModelBackend(ModelBackend):
    """Django's ModelBackend behind the throttle: an attempt a limit refuses is refused before
    its password is checked (the refusal is left on the request for the login view); an
    admitted one counts as a failure unless its password is right, which clears the count."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if username is None:
            username = kwargs.get(UserModel.USERNAME_FIELD)
        if username is None:
            return super().authenticate(request, username=username, password=password, **kwargs)
        refused = admit(username, client_address(request))
        if refused is not None:
            if request is not None:
                setattr(request, REFUSAL_ATTRIBUTE, refused)
            return None
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is not None:
            reset(username)
        return user
