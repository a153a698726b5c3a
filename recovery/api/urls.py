"""The engine's HTTP API, mounted under ``api/`` by ``config/urls.py``."""

from django.urls import path

from recovery.api import decisions, incidents, run_events, runs
from recovery.api import views as api

app_name = "api"

urlpatterns = [
    path("events/<str:workflow_name>", api.events, name="events"),
    path("workflows/<str:workflow_name>/pauses", incidents.pauses, name="workflow-pauses"),
    path("workflows/<str:workflow_name>/pause", incidents.pause, name="workflow-pause"),
    path("workflows/<str:workflow_name>/unpause", incidents.unpause, name="workflow-unpause"),
    # Before the run actions: a workflow id may hold colons and slashes, and "events" is no action.
    path("inbox", decisions.listed, name="inbox"),
    path("runs/<path:workflow_id>/events", run_events.deliver, name="run-events"),
    path("runs/<path:workflow_id>/decisions", decisions.decide, name="run-decisions"),
    path("runs/<path:workflow_id>/<str:action>", runs.act, name="run-act"),
]
