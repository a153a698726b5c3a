from importlib import import_module

from django.apps import AppConfig
from django.conf import settings


class RecoveryConfig(AppConfig):
    name = "recovery"
    verbose_name = "Recovery engine"

    def ready(self) -> None:
        from django.db.backends.signals import connection_created

        from recovery import (
            checks,  # noqa: F401  (registers the system checks)
            tasks,
            tracing,
        )
        from recovery.engine import dispatch
        from recovery.engine.audit.chain import register_sqlite_functions
        from recovery.redaction import install_log_redaction

        connection_created.connect(register_sqlite_functions, dispatch_uid="recovery_audit_hash")
        install_log_redaction()
        tracing.configure()  # both do nothing unless RECOVERY_TRACING=1 and OpenTelemetry is installed
        tracing.instrument()
        # With RECOVERY_EXECUTOR=celery, a committed change queues its task (looked up at each
        # call, so a test may replace a task's delay).
        dispatch.install(run=lambda pk: tasks.advance_run.delay(pk), message=lambda pk: tasks.publish_outbox.delay(pk))

        for module in settings.RECOVERY_WORKFLOW_MODULES:
            import_module(module)
