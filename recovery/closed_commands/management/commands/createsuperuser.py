from ._closed import ClosedCommand


class Command(ClosedCommand):
    help = "Closed: create console users with createoperator (a supervisor, with who and why recorded)."
    instead = "createoperator USERNAME --group supervisor --reason TEXT"
