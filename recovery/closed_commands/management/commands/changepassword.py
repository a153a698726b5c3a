from ._closed import ClosedCommand


class Command(ClosedCommand):
    help = "Closed: change a console user's password with createoperator (validated, with who and why recorded)."
    instead = "createoperator USERNAME --group ROLE --password NEW --reason TEXT"
