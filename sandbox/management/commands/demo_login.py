from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from recovery.management.base import RecoveryCommand


class Command(RecoveryCommand):
    help = "Create (or reset) the demo login for the embedded default and print it. Refused unless DJANGO_DEBUG is on."

    def handle(self, *args, **options):
        if not settings.DEBUG:
            raise CommandError("demo_login only runs with DJANGO_DEBUG on; use createsuperuser in production")
        User = get_user_model()
        user, _ = User.objects.get_or_create(username="demo", defaults={"is_staff": True, "is_superuser": True})
        user.is_staff = user.is_superuser = True
        user.set_password("demo")
        user.save()
        roles = [name for name in ("supervisor", "operator", "viewer") if User.objects.filter(username=name).exists()]
        others = "".join(f", {name}/{name}" for name in roles)
        self.stdout.write(f"demo logins (user/password): demo/demo (superuser){others}")
