from importlib import import_module

from django.apps import AppConfig
from django.conf import settings


class RecoveryConfig(AppConfig):
    name = "recovery"
    verbose_name = "Recovery engine"

    def ready(self) -> None:
        from django.db.backends.signals import connection_created

        from . import checks  # noqa: F401  (registers the system checks)
        from .audit_chain import register_sqlite_functions
        from .redaction import install_log_redaction

        connection_created.connect(register_sqlite_functions, dispatch_uid="recovery_audit_hash")
        install_log_redaction()

        for module in settings.RECOVERY_WORKFLOW_MODULES:
            import_module(module)
