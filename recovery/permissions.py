"""Who may do what in the console. Checked on the server for every action, whatever the page
showed: a viewer reads; an operator also resumes, reconciles and retries; a supervisor also
compensates, terminates and acts in bulk. Superusers are supervisors."""

from __future__ import annotations

from enum import IntEnum

from django.contrib.auth.models import AbstractBaseUser


class Role(IntEnum):
    NONE = 0
    VIEWER = 1
    OPERATOR = 2
    SUPERVISOR = 3


# action -> the lowest role allowed to perform it
REQUIRED_ROLE: dict[str, Role] = {
    "view": Role.VIEWER,
    "export": Role.VIEWER,
    "resume": Role.OPERATOR,
    "reconcile": Role.OPERATOR,
    "retry": Role.OPERATOR,
    "compensate": Role.SUPERVISOR,
    "terminate": Role.SUPERVISOR,
    "bulk": Role.SUPERVISOR,
    "sandbox": Role.SUPERVISOR,
}


def role_of(user: AbstractBaseUser | None) -> Role:
    if user is None or not user.is_authenticated or not user.is_active:
        return Role.NONE
    if user.is_superuser:
        return Role.SUPERVISOR
    names = set(user.groups.values_list("name", flat=True))
    for role in (Role.SUPERVISOR, Role.OPERATOR, Role.VIEWER):
        if role.name.lower() in names:
            return role
    return Role.NONE


def can(user: AbstractBaseUser | None, action: str) -> bool:
    return role_of(user) >= REQUIRED_ROLE[action]
