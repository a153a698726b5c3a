import getpass
import secrets
import sys

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser, Group
from django.core.exceptions import ValidationError
from django.core.management.base import CommandError
from django.db import transaction

from recovery.management.base import RecoveryCommand

ROLES = ("viewer", "operator", "supervisor")


def create_operator(*, username: str, group: str, password: str) -> tuple[AbstractBaseUser, bool]:
    """Create or update an active console user holding exactly one role: the role's group
    (created if missing), and none of the other role groups; other groups are kept. Returns
    the user and whether it was created. Raises ValueError for a bad role, name or password,
    writing nothing then."""
    if group not in ROLES:
        raise ValueError(f"unknown group {group!r} (expected one of: {', '.join(ROLES)})")
    if not password:
        raise ValueError("the password must not be empty")
    User = get_user_model()
    try:
        User._meta.get_field(User.USERNAME_FIELD).run_validators(username)
    except ValidationError as exc:
        raise ValueError(f"invalid username {username!r}: {' '.join(exc.messages)}") from None
    with transaction.atomic():
        user, created = User.objects.get_or_create(**{User.USERNAME_FIELD: username})
        user.is_active = True
        if created or not user.check_password(password):
            # An unchanged password keeps the user's sessions: a new hash would log them out.
            user.set_password(password)
        user.save()
        role, _ = Group.objects.get_or_create(name=group)
        user.groups.remove(*Group.objects.filter(name__in=[r for r in ROLES if r != group]))
        user.groups.add(role)
    return user, created


class Command(RecoveryCommand):
    help = (
        "Create or update a console user in one role group (viewer, operator or supervisor); without --password, "
        "prompts on a terminal, otherwise generates one and prints it."
    )

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--group", required=True, choices=ROLES, help="the user's role")
        parser.add_argument("--password", help="the password (default: prompt on a terminal, else generate one)")

    def handle(self, *args, username, group, password, **options):
        generated = False
        if password is None:
            if sys.stdin.isatty():
                password = getpass.getpass("Password: ")
                if password != getpass.getpass("Password (again): "):
                    raise CommandError("the passwords do not match; nothing was changed")
            else:
                password, generated = secrets.token_urlsafe(12), True
        try:
            _, created = create_operator(username=username, group=group, password=password)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        line = f"{'created' if created else 'updated'} {username!r} in group {group}"
        self.stdout.write(f"{line}; password: {password}" if generated else line)
