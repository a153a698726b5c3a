from django.contrib import admin

from recovery.admin import ReadOnly  # the simulated systems change through HTTP and `manage.py sandbox`

from .models import Fault, IdempotencyRecord, LedgerEntry, Message, Task


@admin.register(Task)
class TaskAdmin(ReadOnly):
    list_display = ["id", "title", "assignee", "status", "idempotency_key", "created_at"]
    list_filter = ["status"]
    search_fields = ["idempotency_key", "title"]


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(ReadOnly):
    list_display = ["key", "response_status", "created_at"]
    search_fields = ["key"]


@admin.register(Message)
class MessageAdmin(ReadOnly):
    list_display = ["id", "kind", "to", "client_ref", "corrects", "created_at"]
    list_filter = ["kind"]
    search_fields = ["client_ref", "text"]


@admin.register(LedgerEntry)
class LedgerEntryAdmin(ReadOnly):
    list_display = ["id", "kind", "reference", "amount", "currency", "account", "reverses", "created_at"]
    list_filter = ["kind"]
    search_fields = ["reference"]


@admin.register(Fault)
class FaultAdmin(ReadOnly):
    list_display = ["service", "operation", "mode", "remaining", "retry_after", "delay_ms", "created_at"]
    list_filter = ["service", "mode"]
