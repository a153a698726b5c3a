from django.core.management.base import CommandError

from recovery.accounts import Actor, deactivate_operator
from recovery.management.base import RecoveryCommand


class Command(RecoveryCommand):
    help = "Deactivate a console user (no more logins; open sessions end), recording who and why."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--reason", required=True, help="why (recorded with the change)")
        parser.add_argument("--by", help="who asks for the change (recorded beside the OS user; default: the OS user)")

    def handle(self, *args, username, reason, by, **options):
        try:
            events = deactivate_operator(
                username=username, actor=Actor.command("deactivateoperator", by=by), reason=reason
            )
        except ValueError as exc:
            raise CommandError(f"{str(exc).rstrip('.')}; nothing was changed") from None
        self.stdout.write(f"deactivated {username!r}" if events else f"{username!r} was inactive already")
