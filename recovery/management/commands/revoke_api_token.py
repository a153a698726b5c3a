from django.core.management.base import CommandError

from recovery.api.tokens import revoke_token
from recovery.management.base import RecoveryCommand
from recovery.models import ApiToken


class Command(RecoveryCommand):
    help = "Revoke an API token by name: it is refused from now on (revoking it again changes nothing)."

    def add_arguments(self, parser):
        parser.add_argument("name")

    def handle(self, *args, name, **options):
        try:
            token = revoke_token(name=name)
        except ApiToken.DoesNotExist:
            raise CommandError(f"no API token named {name!r}") from None
        self.stdout.write(f"revoked: {token.name} ({token.prefix}…) since {token.revoked_at.isoformat()}")
