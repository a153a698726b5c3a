from recovery.management.base import RecoveryCommand
from recovery.models import AccountEvent
from recovery.text import printable


class Command(RecoveryCommand):
    help = "List the changes to console accounts (who, why, what), oldest first; --user for one account's."

    def add_arguments(self, parser):
        parser.add_argument("--user", metavar="USERNAME", help="only this account's changes")

    def handle(self, *args, user, **options):
        events = AccountEvent.objects.all()
        if user:
            events = events.filter(username=user)
        for event in events.iterator():
            # Stored text printed escaped: a reason or a name cannot repaint the reader's terminal.
            self.stdout.write(printable(str(event)))
