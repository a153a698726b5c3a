from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group

from recovery.models import (
    AccountEvent,
    ApiToken,
    AuditEvent,
    ModelDecision,
    OutboxMessage,
    StepExecution,
    WorkflowRun,
)


class ReadOnly(admin.ModelAdmin):
    """State changes go through recovery.engine.transitions only; the admin is for reading."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class StepInline(admin.TabularInline):
    model = StepExecution
    fields = [
        "position",
        "step_name",
        "state",
        "attempts",
        "idempotency_key",
        "remote_ref",
        "last_error_kind",
        "last_error",
        "next_attempt_at",
    ]
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(WorkflowRun)
class RunAdmin(ReadOnly):
    list_display = ["workflow_id", "workflow_name", "state", "current_step", "updated_at"]
    list_filter = ["state", "workflow_name"]
    search_fields = ["workflow_id"]
    inlines = [StepInline]


@admin.register(AuditEvent)
class AuditAdmin(ReadOnly):
    list_display = ["at", "run", "step_name", "actor", "action", "reason"]
    list_filter = ["action", "actor"]


@admin.register(ModelDecision)
class DecisionAdmin(ReadOnly):
    list_display = ["run", "step_name", "version", "state", "created_at"]


@admin.register(OutboxMessage)
class OutboxAdmin(ReadOnly):
    list_display = ["run", "step_name", "state", "attempts", "provider_ref", "next_attempt_at", "last_error_kind"]
    list_filter = ["state", "step_name"]


@admin.register(ApiToken)
class ApiTokenAdmin(ReadOnly):
    """Tokens are issued and revoked with create_api_token / revoke_api_token; only a hash is kept."""

    list_display = ["name", "prefix", "workflow_name", "created_at", "revoked_at", "last_used_at"]
    exclude = ["token_hash"]


# Users and groups are read-only too, even for a superuser: accounts change through
# `manage.py createoperator` (recovery.accounts), which validates the password and records who
# and why (AccountEvent). A writable user admin let one superuser mint a second supervisor.
for model in (get_user_model(), Group):
    if admin.site.is_registered(model):
        admin.site.unregister(model)


@admin.register(get_user_model())
class UserAdmin(ReadOnly):
    list_display = ["username", "is_active", "is_superuser", "role_groups", "last_login", "date_joined"]
    list_filter = ["is_active", "is_superuser", "groups"]
    search_fields = ["username"]
    fields = ["username", "is_active", "is_staff", "is_superuser", "groups", "last_login", "date_joined"]
    readonly_fields = fields  # never the password hash

    @admin.display(description="groups")
    def role_groups(self, user) -> str:
        return ", ".join(sorted(user.groups.values_list("name", flat=True)))


@admin.register(Group)
class GroupAdmin(ReadOnly):
    list_display = ["name"]
    fields = ["name"]
    readonly_fields = fields


@admin.register(AccountEvent)
class AccountEventAdmin(ReadOnly):
    """Every change to a console account, who made it and why (append-only)."""

    list_display = ["at", "actor", "os_user", "via", "username", "action", "before", "after", "reason"]
    list_filter = ["action", "via"]
    search_fields = ["username", "actor"]
