"""The operator console, mounted at the site root by config/urls.py (namespace ``console``)."""

from django.urls import path

from recovery.console import event_views, export_views, inbox_views, restart_views, views

app_name = "console"

urlpatterns = [
    path("", views.runs_list, name="runs"),
    path("runs/<path:workflow_id>/act", views.run_action, name="run-action"),
    path("runs/<path:workflow_id>/restart", restart_views.run_restart, name="run-restart"),
    path("runs/<path:workflow_id>/event", event_views.run_event, name="run-event"),
    path("runs/<path:workflow_id>", views.run_detail, name="run"),
    path("bulk", views.bulk_action, name="bulk"),
    path("dashboard", views.dashboard, name="dashboard"),
    path("inbox", inbox_views.inbox_page, name="inbox"),
    path("workflows/pauses", views.workflow_pauses, name="workflow-pauses"),
    path("audit/export", export_views.export_audit, name="audit-export"),
]
