"""``manage.py check --deploy`` warns when a production deployment (DJANGO_DEBUG=0) has the demo
on (docs/security.md "The demo in production")."""

from django.conf import settings
from django.core import checks


@checks.register(checks.Tags.security, deploy=True)
def check_demo_in_production(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    if settings.RECOVERY_DEMO and not settings.DEBUG:
        return [
            checks.Warning(
                "RECOVERY_DEMO is on with DJANGO_DEBUG off: a supervisor can arm faults, clear the simulated "
                "systems, start runs without a token and reseed this database from /demo",
                hint="unset RECOVERY_DEMO unless this deployment is a demo with databases of its own",
                id="sandbox.W001",
            )
        ]
    return []
