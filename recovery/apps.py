from importlib import import_module

from django.apps import AppConfig
from django.conf import settings


class RecoveryConfig(AppConfig):
    name = "recovery"
    verbose_name = "Recovery engine"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
        from .redaction import install_log_redaction

        install_log_redaction()

        for module in settings.RECOVERY_WORKFLOW_MODULES:
            import_module(module)
