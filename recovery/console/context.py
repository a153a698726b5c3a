"""Template context for every page: what the signed-in person's role allows (``may.sandbox``,
``may.act``…), so that a page never offers a link or a button the server would refuse; and
whether any executor is live (the "no executor" banner)."""

from __future__ import annotations

from django.http import HttpRequest
from django.utils.functional import SimpleLazyObject

from recovery import clock, executors
from recovery.permissions import REQUIRED_ROLE, can


class _May:
    def __init__(self, user) -> None:
        self._user = user

    def __getattr__(self, action: str) -> bool:
        if action not in REQUIRED_ROLE:
            raise AttributeError(action)
        return can(self._user, action)


def roles(request: HttpRequest) -> dict[str, object]:
    return {"may": _May(getattr(request, "user", None))}


def executor_health(request: HttpRequest) -> dict[str, object]:
    """``executor_health`` (recovery.executors.Health) for the banner every console page shows
    while no executor is live: one small query, for a signed-in person only."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    now = clock.now()
    return {
        # read once, when a page that shows the banner (base.html) renders it; an htmx part does not
        "executor_health": SimpleLazyObject(lambda: executors.health(now)),
        "executor_start_hint": executors.START_HINT,
        "executor_silent_seconds": executors.silent_after().total_seconds(),
    }
