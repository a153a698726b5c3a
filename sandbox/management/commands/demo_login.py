from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from recovery.accounts import Actor, ensure_superuser
from recovery.management.base import RecoveryCommand
from sandbox import demo_logins


class Command(RecoveryCommand):
    help = (
        "Create the demo login (superuser 'demo') for the embedded default and print the demo logins and their "
        "password (var/demo-password). Refused unless DJANGO_DEBUG is on."
    )

    def handle(self, *args, **options):
        if not settings.DEBUG:
            raise CommandError("demo_login only runs with DJANGO_DEBUG on; use createoperator in production")
        password = demo_logins.demo_password()
        try:
            user, _ = ensure_superuser(
                username=demo_logins.SUPERUSER,
                password=password,
                actor=Actor.command("demo_login"),
                reason=demo_logins.REASON,
                verified=demo_logins.verified(demo_logins.SUPERUSER),
            )
            demo_logins.remember(user)
        except ValueError as exc:
            raise CommandError(f"{exc} (edit or remove {demo_logins.password_file()})") from None
        User = get_user_model()
        roles = [name for name in ("supervisor", "operator", "viewer") if User.objects.filter(username=name).exists()]
        others = "".join(f", {name}" for name in roles)
        self.stdout.write(f"demo logins: {demo_logins.SUPERUSER} (superuser){others}; password: {password}")
