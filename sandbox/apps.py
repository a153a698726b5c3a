from django.apps import AppConfig


class SandboxConfig(AppConfig):
    name = "sandbox"
    verbose_name = "Simulated external systems"

    def ready(self) -> None:
        from sandbox import checks  # noqa: F401 - registers the demo's deployment check
