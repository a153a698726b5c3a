from django.apps import AppConfig


class ClosedCommandsConfig(AppConfig):
    """Django's own account commands, closed: listed before ``django.contrib.auth`` in
    INSTALLED_APPS, so ``manage.py createsuperuser`` and ``changepassword`` are these. Accounts
    change only through ``createoperator`` and ``deactivateoperator``, which check the password
    and record who and why (recovery.accounts); Django's would set a password, or mint a
    superuser that counts as a supervisor, with no record (docs/security.md)."""

    name = "recovery.closed_commands"
    label = "recovery_closed_commands"
