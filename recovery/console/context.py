"""Template context for every page: what the signed-in person's role allows (``may.sandbox``,
``may.act``…), so that a page never offers a link or a button the server would refuse."""

from __future__ import annotations

from django.http import HttpRequest

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
