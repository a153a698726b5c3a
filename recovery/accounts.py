"""Console accounts: who may log in, in which role, and the append-only record of every change.

One function per change (``create_operator``, ``deactivate_operator``, ``ensure_superuser``),
each writing its ``AccountEvent`` rows in the same transaction as the change, with who made it
and why — as Zulip's ``do_*`` actions write their ``RealmAuditLog``. The admin shows users
read-only (recovery.admin): these functions, behind ``manage.py createoperator`` and
``deactivateoperator``, are the way to add a user, change a role or a password, or shut an
account. Every password passes Django's validators (settings.AUTH_PASSWORD_VALIDATORS) before
anything is written."""

from __future__ import annotations

import getpass
import os
import secrets
from dataclasses import dataclass

from django.contrib.auth import get_user_model, password_validation
from django.contrib.auth.models import AbstractBaseUser, Group
from django.core.exceptions import ValidationError
from django.db import transaction

from recovery import clock
from recovery.engine.transitions import require_reason
from recovery.errors import InvalidTransition
from recovery.models import AccountAction, AccountEvent

ROLES = ("viewer", "operator", "supervisor")


# AccountEvent is append-only in the database (migration 0030), as the audit trail is.
TABLE = "recovery_accountevent"
POSTGRESQL_INSTALL = [
    """CREATE FUNCTION recovery_account_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'account events are append-only: % refused', TG_OP USING ERRCODE = 'insufficient_privilege';
END
$$""",
    f"""CREATE TRIGGER recovery_account_append_only BEFORE UPDATE OR DELETE ON {TABLE}
    FOR EACH STATEMENT EXECUTE FUNCTION recovery_account_append_only()""",
    f"""CREATE TRIGGER recovery_account_no_truncate BEFORE TRUNCATE ON {TABLE}
    FOR EACH STATEMENT EXECUTE FUNCTION recovery_account_append_only()""",
]
POSTGRESQL_UNINSTALL = [
    f"DROP TRIGGER IF EXISTS recovery_account_no_truncate ON {TABLE}",
    f"DROP TRIGGER IF EXISTS recovery_account_append_only ON {TABLE}",
    "DROP FUNCTION IF EXISTS recovery_account_append_only()",
]
SQLITE_NO_DELETE = f"""CREATE TRIGGER recovery_account_no_delete BEFORE DELETE ON {TABLE}
BEGIN
    SELECT RAISE(ABORT, 'account events are append-only: DELETE refused');
END"""
SQLITE_INSTALL = [
    f"""CREATE TRIGGER recovery_account_no_update BEFORE UPDATE ON {TABLE}
BEGIN
    SELECT RAISE(ABORT, 'account events are append-only: UPDATE refused');
END""",
    SQLITE_NO_DELETE,
]
SQLITE_UNINSTALL = [
    "DROP TRIGGER IF EXISTS recovery_account_no_delete",
    "DROP TRIGGER IF EXISTS recovery_account_no_update",
]


def install_statements(vendor: str) -> list[str]:
    return POSTGRESQL_INSTALL if vendor == "postgresql" else SQLITE_INSTALL


def uninstall_statements(vendor: str) -> list[str]:
    return POSTGRESQL_UNINSTALL if vendor == "postgresql" else SQLITE_UNINSTALL


# --- who makes a change ----------------------------------------------------------------------


@dataclass(frozen=True)
class Actor:
    """Who makes a change: ``name`` (a console user, or the person a command names with
    ``--by``), ``via`` (the command or page) and, for a command, the OS user it runs as."""

    name: str
    via: str
    os_user: str = ""

    @classmethod
    def command(cls, via: str, *, by: str | None = None) -> Actor:
        who = os_user()
        name = (by or "").strip() or who
        if len(name) > 150 or any(not c.isprintable() for c in name):
            raise ValueError("--by must be a name of at most 150 printable characters")
        return cls(name=name, via=via, os_user=who)


def os_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no USER/LOGNAME and a uid without a passwd entry (a container)
        return f"uid {os.getuid()}"


# --- passwords -------------------------------------------------------------------------------


def check_password_strength(password: str, *, user: AbstractBaseUser) -> None:
    """Raise ValueError, in one line, unless ``password`` passes every configured validator."""
    if not password:
        raise ValueError("the password must not be empty")
    try:
        password_validation.validate_password(password, user=user)
    except ValidationError as exc:
        raise ValueError(f"the password is too weak: {' '.join(exc.messages)}") from None


def generated_password(*, user: AbstractBaseUser) -> str:
    """A random password (96 bits, 16 characters) that passes the validators."""
    while True:
        password = secrets.token_urlsafe(12)
        try:
            check_password_strength(password, user=user)
        except ValueError:  # practically never (all digits, or like the username): draw again
            continue
        return password


# --- changes -----------------------------------------------------------------------------------


def _reason(reason: str) -> str:
    try:
        return require_reason(reason)
    except InvalidTransition as exc:
        raise ValueError(str(exc)) from None


def _role(user: AbstractBaseUser) -> str:
    names = set(user.groups.values_list("name", flat=True))
    return next((r for r in reversed(ROLES) if r in names), "")


def create_operator(
    *, username: str, group: str, password: str, actor: Actor, reason: str, verified: str = ""
) -> tuple[AbstractBaseUser, bool, list[AccountEvent]]:
    """Create or update an active console user holding exactly one role: the role's group
    (created if missing), and none of the other role groups; other groups are kept. Every
    change is one AccountEvent (created; role from → to; password changed; activated) in the
    same transaction; nothing changed, nothing recorded. Returns the user, whether it was
    created, and the events. Raises ValueError for a bad role, name, password or reason,
    writing nothing then. ``verified``: see ``_same_password``."""
    if group not in ROLES:
        raise ValueError(f"unknown group {group!r} (expected one of: {', '.join(ROLES)})")
    reason = _reason(reason)
    User = get_user_model()
    try:
        User._meta.get_field(User.USERNAME_FIELD).run_validators(username)
    except ValidationError as exc:
        raise ValueError(f"invalid username {username!r}: {' '.join(exc.messages)}") from None
    with transaction.atomic():
        user, created = _locked_user(username, password)
        changes: list[tuple[str, str, str]] = []
        if created:
            changes.append((AccountAction.CREATED, "", group))
        else:
            if not user.is_active:
                changes.append((AccountAction.ACTIVATED, "", ""))
            if _role(user) != group:
                changes.append((AccountAction.ROLE_CHANGED, _role(user), group))
        if created or not _same_password(user, password, verified):
            # An unchanged password keeps the user's sessions: a new hash would log them out.
            user.set_password(password)
            if not created:
                changes.append((AccountAction.PASSWORD_CHANGED, "", ""))
        user.is_active = True
        user.save()
        role, _ = Group.objects.get_or_create(name=group)
        user.groups.remove(*Group.objects.filter(name__in=[r for r in ROLES if r != group]))
        user.groups.add(role)
        events = _record(username, changes, actor=actor, reason=reason)
    return user, created, events


def _locked_user(username: str, password: str) -> tuple[AbstractBaseUser, bool]:
    """``username``'s user, locked until the transaction ends, or a new unsaved one (and True);
    ValueError if ``password`` is too weak for it."""
    User = get_user_model()
    user = User.objects.select_for_update().filter(**{User.USERNAME_FIELD: username}).first()
    created = user is None
    if created:
        user = User(**{User.USERNAME_FIELD: username})
    check_password_strength(password, user=user)
    return user, created


def deactivate_operator(*, username: str, actor: Actor, reason: str) -> list[AccountEvent]:
    """Make ``username`` inactive: it can no longer log in, and its open sessions end at their
    next request (Django refuses an inactive user's session). One AccountEvent (its role
    before), none if it was inactive already. Raises ValueError for an unknown user or a bad
    reason, writing nothing then."""
    reason = _reason(reason)
    User = get_user_model()
    with transaction.atomic():
        user = User.objects.select_for_update().filter(**{User.USERNAME_FIELD: username}).first()
        if user is None:
            raise ValueError(f"no user {username!r}")
        if not user.is_active:
            return []
        user.is_active = False
        user.save(update_fields=["is_active"])
        role = "superuser" if user.is_superuser else _role(user)
        return _record(username, [(AccountAction.DEACTIVATED, role, "")], actor=actor, reason=reason)


def ensure_superuser(
    *, username: str, password: str, actor: Actor, reason: str, verified: str = ""
) -> tuple[AbstractBaseUser, list[AccountEvent]]:
    """The demo's superuser (sandbox's demo_login): create ``username`` as an active superuser
    with ``password``, or make it one and set the password if either differs. One AccountEvent
    per change, none when nothing changed. Raises ValueError for a weak password or a bad
    reason, writing nothing then. ``verified``: see ``_same_password``."""
    reason = _reason(reason)
    with transaction.atomic():
        user, created = _locked_user(username, password)
        changes: list[tuple[str, str, str]] = []
        if created:
            changes.append((AccountAction.CREATED, "", "superuser"))
        elif not (user.is_superuser and user.is_staff and user.is_active):
            before = "superuser" if user.is_superuser else _role(user)
            changes.append((AccountAction.ROLE_CHANGED, before, "superuser"))
        if created or not _same_password(user, password, verified):
            user.set_password(password)
            if not created:
                changes.append((AccountAction.PASSWORD_CHANGED, "", ""))
        if changes:
            user.is_staff = user.is_superuser = user.is_active = True
            user.save()
        return user, _record(username, changes, actor=actor, reason=reason)


def _same_password(user: AbstractBaseUser, password: str, verified: str) -> bool:
    """Whether ``user``'s password is ``password``. Checking costs a key derivation (hundreds of
    milliseconds, by design); ``verified`` is a stored hash the caller saw match ``password``
    before: a stored hash that is still exactly that string (a new password gets a new salt) is
    the same password, unchecked."""
    return bool(verified) and user.password == verified or user.check_password(password)


def _record(username: str, changes: list[tuple[str, str, str]], *, actor: Actor, reason: str) -> list[AccountEvent]:
    now = clock.now()
    return AccountEvent.objects.bulk_create(
        AccountEvent(
            at=now,
            actor=actor.name,
            os_user=actor.os_user,
            via=actor.via,
            username=username,
            action=action,
            before=before,
            after=after,
            reason=reason,
        )
        for action, before, after in changes
    )
