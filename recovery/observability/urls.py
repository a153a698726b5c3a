"""Mounted at the site's root by ``config/urls.py``."""

from django.urls import path

from recovery.observability import views

app_name = "observability"

urlpatterns = [
    path("metrics", views.metrics, name="metrics"),
    path("healthz", views.healthz, name="healthz"),
    path("readyz", views.readyz, name="readyz"),
]
