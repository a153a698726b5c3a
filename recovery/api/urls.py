"""The engine's HTTP API, mounted under ``api/`` by ``config/urls.py``."""

from django.urls import path

from recovery.api import views as api

app_name = "api"

urlpatterns = [
    path("events/<str:workflow_name>", api.events, name="events"),
]
