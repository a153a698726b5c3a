from django.core.management.base import BaseCommand


class RecoveryCommand(BaseCommand):
    """A command whose bad arguments print one line on stderr (no usage block) and exit 2."""

    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.print_usage = lambda file=None: None
        return parser
