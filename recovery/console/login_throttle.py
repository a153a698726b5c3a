"""Login throttling: a username with RECOVERY_LOGIN_MAX_FAILURES failed logins in the last
RECOVERY_LOGIN_LOCKOUT_SECONDS is refused, even with the right password, until fewer failures
remain in that window; a successful login clears its failures.

Failures are rows in the engine's database (``LoginFailure``), so every web process sees the
same count. Attempts refused while locked are not counted (the lock ends on time however hard
someone knocks) and never check the password. Counting is not locked: processes racing on the
last allowed attempts may let one or two more through, never an unbounded number. The lock is
per username, not per IP address: behind a proxy every operator shares one address, and one
attacker would lock them all out.

The check sits in the authentication backend, so it holds for every login form (the console's
and the admin's); the console's login view only explains it (recovery.console.auth_views)."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.backends import ModelBackend, UserModel
from django.db import transaction

from recovery import clock
from recovery.models import LoginFailure

USERNAME_LENGTH = LoginFailure._meta.get_field("username").max_length


def normalise(username: str) -> str:
    """One key for "Alice", " alice" and "ALICE", so that case does not buy more attempts."""
    return username.strip().casefold()[:USERNAME_LENGTH]


def _window(now: datetime) -> datetime:
    return now - timedelta(seconds=settings.RECOVERY_LOGIN_LOCKOUT_SECONDS)


def locked_until(username: str, *, now: datetime | None = None) -> datetime | None:
    """When ``username`` may try again, or None if it may now."""
    now = now or clock.now()
    limit = settings.RECOVERY_LOGIN_MAX_FAILURES
    recent = list(
        LoginFailure.objects.filter(username=normalise(username), at__gt=_window(now))
        .order_by("-at")
        .values_list("at", flat=True)[:limit]
    )
    if len(recent) < limit:
        return None
    # Open again once the oldest of the last `limit` failures leaves the window.
    return recent[-1] + timedelta(seconds=settings.RECOVERY_LOGIN_LOCKOUT_SECONDS)


def record_failure(username: str, *, now: datetime | None = None) -> None:
    """Count one failed login, and forget every failure that has left the window."""
    now = now or clock.now()
    with transaction.atomic():
        LoginFailure.objects.filter(at__lte=_window(now)).delete()
        LoginFailure.objects.create(username=normalise(username), at=now)


def reset(username: str) -> None:
    LoginFailure.objects.filter(username=normalise(username)).delete()


class ThrottledModelBackend(ModelBackend):
    """Django's ModelBackend behind the throttle: a locked username is refused before its
    password is checked; a wrong password is counted; a right one clears the count."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if username is None:
            username = kwargs.get(UserModel.USERNAME_FIELD)
        if username is None:
            return super().authenticate(request, username=username, password=password, **kwargs)
        if locked_until(username) is not None:
            return None
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is None:
            record_failure(username)
        else:
            reset(username)
        return user
