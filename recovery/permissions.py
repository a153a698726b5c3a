"""Who may do what in the console. Checked on the server for every action, whatever the page
showed: a viewer reads; an operator also resumes, reconciles and retries; a supervisor also
terminates, changes or asks again for a model's decision and accepts a proposal a guard
refused. Bulk applies an action to many runs for whoever may do that action. Compensating
needs at least an operator, and the role each compensation names (``@step.compensate(who=…)``).
Superusers are supervisors."""

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
    "act": Role.OPERATOR,  # post any action on a run at all; the action then needs its own role
    "resume": Role.OPERATOR,
    "reconcile": Role.OPERATOR,
    "retry": Role.OPERATOR,
    "compensate": Role.OPERATOR,  # and each compensated step's own ``who`` (transitions check it)
    "terminate": Role.SUPERVISOR,
    "supersede": Role.SUPERVISOR,  # replace a model's decision (edited, or asked again)
    "override": Role.SUPERVISOR,  # accept a proposal a guard refused
    "snooze": Role.SUPERVISOR,  # silence a stuck run's alert, with a reason
    "stop_agent": Role.OPERATOR,  # halt an agent step's loop (nothing more is asked or sent)
    "fork_agent": Role.SUPERVISOR,  # let a stopped agent go on, or ask it again from an earlier turn
    "move_version": Role.SUPERVISOR,  # move a run to another version of its workflow (after a deploy)
    "restart": Role.SUPERVISOR,  # restart a run from a step with a corrected input or intent
    "reset_attempts": Role.SUPERVISOR,  # give a step waiting for its retry its whole budget back
    "pause_workflow": Role.SUPERVISOR,  # pause (and unpause) a whole workflow, or one step of it
    "send_event": Role.OPERATOR,  # send a run the event its wait waits for (an approver's answer, in their stead)
    "take": Role.OPERATOR,  # take an inbox item ("I take this"): a call to decide, a wait for an event
    "decide_call": Role.OPERATOR,  # approve, edit, reject or answer a tool call; and the tool's own approver role
    "approve": Role.SUPERVISOR,  # a four-eyes request (recovery.engine.transitions.approval_grant)
    "bulk": Role.OPERATOR,  # the bulk form; each action then needs its own role (terminate: a supervisor)
    "sandbox": Role.SUPERVISOR,
}


# role_of remembers the role on the user object: a request's user is loaded once per request,
# so its groups are read once per page however many times ``can`` is asked (like Django's own
# permission cache, a change of groups shows from the next request).
_ROLE_CACHE = "_recovery_role"


def role_of(user: AbstractBaseUser | None) -> Role:
    if user is None or not user.is_authenticated or not user.is_active:
        return Role.NONE
    if user.is_superuser:
        return Role.SUPERVISOR
    cached = getattr(user, _ROLE_CACHE, None)
    if cached is not None:
        return cached
    names = set(user.groups.values_list("name", flat=True))
    role = next(
        (r for r in (Role.SUPERVISOR, Role.OPERATOR, Role.VIEWER) if r.name.lower() in names),
        Role.NONE,
    )
    setattr(user, _ROLE_CACHE, role)
    return role


def can(user: AbstractBaseUser | None, action: str) -> bool:
    return role_of(user) >= REQUIRED_ROLE[action]


def role_named(name: str) -> Role:
    """``"operator"`` → Role.OPERATOR (a workflow's ``who=``)."""
    try:
        return Role[name.upper()]
    except KeyError:
        raise ValueError(f"no role {name!r} (viewer, operator, supervisor)") from None
