import io
import logging
import os
import sys

from django.core.management.base import BaseCommand, CommandError

from recovery.text import printable

logger = logging.getLogger("recovery.commands")


class RecoveryCommand(BaseCommand):
    """A command whose bad arguments print one line on stderr (no usage block) and exit 2, and
    whose reader may stop reading early (``show_run … | head``): no traceback, the usual exit.

    Its one-line errors are printed with every control character shown as an escape (they often
    quote a run's stored text: recovery.text). A crash (any other exception) is logged with its
    traceback through the redacting handler (logger ``recovery.commands``, JSON when
    RECOVERY_LOG_FORMAT=json); from the command line it then ends in one line and exit 1 instead
    of a raw traceback, unless ``--traceback`` is given."""

    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.print_usage = lambda file=None: None
        return parser

    def execute(self, *args, **options):
        try:
            return super().execute(*args, **options)
        except BrokenPipeError:
            # The reader is gone: what is still buffered cannot be written either. Point stdout at
            # /dev/null so that the interpreter's own flush at exit does not complain, and stop.
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError, io.UnsupportedOperation):
                pass  # not a file descriptor (a test's captured stdout): nothing is flushed at exit
            sys.exit(141)  # 128 + SIGPIPE, as a shell reports a reader that stopped early
        except CommandError as exc:
            message = printable(str(exc))
            if type(exc) is not CommandError or message == str(exc):  # a SystemCheckError formats itself
                raise
            raise CommandError(message, returncode=exc.returncode) from None
        except Exception as exc:
            name = self.__module__.rpartition(".")[2]
            logger.exception("manage.py %s crashed: %s", name, type(exc).__name__)
            if getattr(self, "_called_from_command_line", False) and not options.get("traceback"):
                raise CommandError(
                    f"{name} crashed ({type(exc).__name__}); its traceback is logged above, redacted "
                    "(--traceback to raise it)",
                    returncode=1,
                ) from None
            raise
