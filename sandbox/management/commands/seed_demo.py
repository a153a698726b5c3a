"""Demo runs for the console, made by the real engine against the real simulated systems.

The stories are in ``sandbox/demo_scenarios.py``, their player in ``sandbox/demo_player.py``,
what a seed and a reset do in ``sandbox/demo_seed.py``; this command prints its one line.
"""

from __future__ import annotations

from collections import Counter

from django.conf import settings
from django.core.management.base import CommandError

from recovery.management.base import RecoveryCommand
from recovery.models import RunState

# Re-exported: the names the demo page and the tests knew this module by.
from sandbox.demo_scenarios import DISPUTES, SCENARIOS, Dispute, Scenario
from sandbox.demo_seed import (
    Seeded,
    _one_seed_at_a_time,
    current_generation,
    generation_after_reset,
    seed_demo,
    seed_playing,
)
from sandbox.demo_server import sandbox_server

__all__ = [
    "DISPUTES",
    "SCENARIOS",
    "Command",
    "Dispute",
    "Scenario",
    "Seeded",
    "_one_seed_at_a_time",
    "current_generation",
    "generation_after_reset",
    "sandbox_server",
    "seed_demo",
    "seed_playing",
]


class Command(RecoveryCommand):
    help = (
        "Seed fifteen demo invoice runs in every state (completed, waiting, needs_review, failed, compensated, "
        "compensation_failed; two on the invoice workflow's oldest version, v1) and four disputes (one credit "
        "note waiting for a supervisor) through the real engine and simulated systems, dated over the past hours. "
        "Idempotent: demo runs that exist are left as they are, so running it again creates nothing. "
        "--reset plays them again as new runs (ids ending in -r2, -r3 …) after terminating the unfinished ones "
        "of the previous play and closing their open approval tasks in the simulated tracker (done); nothing is "
        "deleted. Running executors leave the demo runs alone while it plays. "
        "In production (DJANGO_DEBUG=0), refused unless the demo is on (RECOVERY_DEMO=1) or --allow-outside-demo "
        "is given."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--sandbox-url",
            help="where the simulated systems answer (default: SANDBOX_URL); if nothing answers there, "
            "a temporary server is started on a free local port for the seed's duration",
        )
        parser.add_argument(
            "--reset",
            action="store_true",
            help="play every scenario again as a new generation of runs; the previous generation's unfinished "
            "runs are terminated (audited, by --as), never deleted, and the earlier generations' open approval "
            "tasks are marked done in the simulated tracker",
        )
        parser.add_argument(
            "--as",
            dest="username",
            metavar="USERNAME",
            help="the supervisor whose name the demo's operator actions carry (default: the first supervisor)",
        )
        parser.add_argument(
            "--allow-outside-demo",
            action="store_true",
            help="seed although RECOVERY_DEMO is off: demo runs in a database you mean to fill with them "
            "(a staging copy), never by accident in production's",
        )

    def handle(self, *args, sandbox_url, reset, username, allow_outside_demo, **options):
        # SPEC §6 keeps a bare `seed_demo` working where people develop (DJANGO_DEBUG, the default);
        # a production database is filled with demo runs only on purpose.
        if not settings.DEBUG and not settings.RECOVERY_DEMO and not allow_outside_demo:
            raise CommandError(
                "seed_demo: the demo is off in production (DJANGO_DEBUG=0 and RECOVERY_DEMO is not set): set "
                "RECOVERY_DEMO=1 where you run the demo, or pass --allow-outside-demo to seed this database on purpose"
            )
        try:
            seeded = seed_demo(sandbox_url=sandbox_url, warn=self.stderr.write, reset=reset, username=username)
        except LookupError as exc:
            raise CommandError(str(exc)) from None
        counts = ", ".join(f"{state} {seeded.states[state]}" for state in RunState.values if seeded.states[state])
        which = f", generation {seeded.generation} (ids end in -r{seeded.generation})" if seeded.generation > 1 else ""
        closed = (
            f"; {seeded.terminated} unfinished run(s) of the previous generation terminated, "
            f"{seeded.tasks_done} open approval task(s) of earlier generations done in the tracker"
            if reset
            else ""
        )
        older = Counter(s.version for s in SCENARIOS if s.version is not None)
        on = "".join(f" ({count} on invoice v{version})" for version, count in sorted(older.items()))
        self.stdout.write(
            f"seed_demo: {seeded.states.total()} demo runs, {len(SCENARIOS)} invoices{on} and {len(DISPUTES)} "
            f"disputes ({seeded.new} new){which}: {counts}{closed}"
        )
