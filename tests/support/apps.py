from django.apps import AppConfig


class SupportConfig(AppConfig):
    name = "tests.support"
    label = "support"
    verbose_name = "Test receivers"
