import getpass
import sys

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from recovery.accounts import ROLES, Actor, create_operator, generated_password
from recovery.management.base import RecoveryCommand

__all__ = ["ROLES", "Command", "create_operator"]

NO_REASON = "no reason given (createoperator without --reason)"


class Command(RecoveryCommand):
    help = (
        "Create or update a console user in one role group (viewer, operator or supervisor), recording who and why; "
        "without --password, prompts on a terminal, otherwise generates one and prints it."
    )

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--group", required=True, choices=ROLES, help="the user's role")
        parser.add_argument("--password", help="the password (default: prompt on a terminal, else generate one)")
        parser.add_argument(
            "--reason",
            help=f"why (recorded with every change to the account; default: prompt on a terminal, else {NO_REASON!r})",
        )
        parser.add_argument("--by", help="who asks for the change (recorded beside the OS user; default: the OS user)")

    def handle(self, *args, username, group, password, reason, by, **options):
        if reason is None:
            # SPEC §6 keeps `createoperator USER --group G [--password P]` working for scripts: the
            # change is still recorded, with who ran it, and says that no reason was given.
            reason = input("Reason: ") if sys.stdin.isatty() else NO_REASON
        generated = False
        if password is None:
            if sys.stdin.isatty():
                password = getpass.getpass("Password: ")
                if password != getpass.getpass("Password (again): "):
                    raise CommandError("the passwords do not match; nothing was changed")
            else:
                User = get_user_model()
                password = generated_password(user=User(**{User.USERNAME_FIELD: username}))
                generated = True
        try:
            _, created, events = create_operator(
                username=username,
                group=group,
                password=password,
                actor=Actor.command("createoperator", by=by),
                reason=reason,
            )
        except ValueError as exc:
            raise CommandError(f"{str(exc).rstrip('.')}; nothing was changed") from None
        line = f"{'created' if created else 'updated'} {username!r} in group {group}"
        if not events:
            line = f"{username!r} unchanged in group {group}"
        self.stdout.write(f"{line}; password: {password}" if generated else line)
