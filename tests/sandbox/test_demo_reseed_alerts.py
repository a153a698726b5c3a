"""No spurious ``lease_expired`` alert while the demo reseeds (issue 33). The seed plays its runs on
a past clock, reserved for itself in real time: while it drives one, the run is RUNNING with a
lease that "expired" hours ago by the real clock. A sweep running beside it (make run's executor)
must not page for it: other executors cannot take a reserved run over."""

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.utils import timezone

from recovery import counts
from recovery.engine import failpoints, transitions
from recovery.models import Alert, RunState, WorkflowRun
from recovery.observability import alerts
from sandbox import demo_player

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])


def lease_expired(now):
    return set(WorkflowRun.objects.filter(counts.stuck_causes(now)["lease_expired"][1]).values_list("pk", flat=True))


def test_a_run_reserved_for_its_player_is_not_lease_expired_until_the_reservation_lapses(clock):
    real = timezone.now()
    clock.current = real - timedelta(hours=3)  # the seed's past clock
    run, _ = transitions.run_start(
        workflow="test_orders",
        data={"tenant": "t", "order_id": "seeded"},
        reserve=("seed-demo", real + timedelta(minutes=15)),
    )
    assert transitions.run_claim(run_pk=run.pk, owner="seed-demo", now=clock.now()) is not None
    run.refresh_from_db()
    assert run.state == RunState.RUNNING and run.lease_expires_at < real  # held, "expired" by the real clock

    assert lease_expired(real) == set()
    alerts.sweep(now=real)
    assert not Alert.objects.filter(cause="lease_expired").exists()

    lapsed = real + timedelta(minutes=16)  # the player died: its reservation lapses, the lease is past
    assert lease_expired(lapsed) == {run.pk}
    alerts.sweep(now=lapsed)
    assert list(Alert.objects.values_list("run_id", "cause")) == [(run.pk, "lease_expired")]


@pytest.mark.slow
def test_sweeps_during_a_demo_reset_raise_no_lease_expired_alert(settings, monkeypatch):
    settings.DEBUG = True
    call_command("seed_demo", stdout=StringIO(), stderr=StringIO())
    held_swept = set()
    advance, publish = demo_player.advance, demo_player.publish

    def sweep():  # what make run's executor does beside the seed, on the real clock
        # Only a RUNNING run can be lease_expired: sweep when a run is held in a way no earlier
        # sweep saw (by whom, reserved until when, its lease past or not by the real clock). A sweep
        # between two steps of one holding would answer the same (and cost CI about a second).
        now = timezone.now()
        held = {
            (pk, owner, reserved_for, reserved_until, lease_expires_at < now)
            for pk, owner, reserved_for, reserved_until, lease_expires_at in WorkflowRun.objects.filter(
                state=RunState.RUNNING
            ).values_list("pk", "lease_owner", "reserved_for", "reserved_until", "lease_expires_at")
        }
        if held - held_swept:
            held_swept.update(held)
            alerts.sweep(now=now)

    def sweeping_advance(run_pk, *, owner):
        sweep()
        try:
            return advance(run_pk, owner=owner)
        finally:
            sweep()  # also after a failpoint stopped the "executor" holding the run

    def sweeping_publish(pk, *, owner):
        sweep()
        return publish(pk, owner=owner)

    hit = failpoints.hit

    def sweeping_hit(step, point):  # mid-step: the run is RUNNING, held by the seed
        if point == "before_call":
            sweep()
        return hit(step, point)

    monkeypatch.setattr(failpoints, "hit", sweeping_hit)
    monkeypatch.setattr(demo_player, "advance", sweeping_advance)
    monkeypatch.setattr(demo_player, "publish", sweeping_publish)
    first_generation = WorkflowRun.objects.order_by("pk").last().pk
    reset_at = timezone.now()
    out, err = StringIO(), StringIO()
    call_command("seed_demo", "--reset", "--as", "supervisor", stdout=out, stderr=err)
    assert "generation 2" in out.getvalue() and err.getvalue() == ""
    # Every run the reset played on its past clock was swept while held with its lease past by the
    # real clock (what the old cause counted as lease_expired).
    played_in_the_past = WorkflowRun.objects.filter(pk__gt=first_generation, created_at__lt=reset_at)
    swept_while_expired = {pk for pk, owner, reserved_for, reserved_until, past in held_swept if past}
    assert swept_while_expired == set(played_in_the_past.values_list("pk", flat=True))
    assert len(swept_while_expired) > 10
    alerts.sweep(now=timezone.now())  # and once the seed is done
    assert not Alert.objects.filter(cause="lease_expired").exists()
    assert Alert.objects.exists()  # the sweeps did raise the demo's stuck runs' alerts
