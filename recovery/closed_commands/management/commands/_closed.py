from django.core.management.base import BaseCommand, CommandError


class ClosedCommand(BaseCommand):
    """A Django account command refused in one line, naming the recorded way to do it."""

    instead = ""

    def add_arguments(self, parser):
        parser.add_argument("args", nargs="*")
        parser.add_argument("--username")
        parser.add_argument("--email")
        parser.add_argument("--noinput", "--no-input", action="store_true")

    def handle(self, *args, **options):
        raise CommandError(
            f"accounts change only through commands that record who and why: use {self.instead} (docs/security.md)"
        )
