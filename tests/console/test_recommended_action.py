"""One recommended action per stuck cause (recovery.actions.RECOMMENDED, recovery.recommend): the
run page shows it first and highlighted, with what it does and what it could send; the others are
under "More actions"; each shows its `manage.py recover` command line; an action that asserts
absence or may send again asks first — by its dialog, or without JavaScript by a page of its own."""

import re
import shlex
from datetime import UTC, datetime
from html import unescape

import pytest
from django.core.management import call_command
from django.urls import reverse

from recovery import clock as engine_clock
from recovery import recommend
from recovery.actions import ACTIONS, NO_RUN_ACTION, RECOMMENDED, command_line
from recovery.counts import stuck_causes
from recovery.management.commands.recover import Command as Recover
from recovery.models import AuditEvent, RunState, StepState, WorkflowRun
from tests.support import receivers, stuck
from tests.support.console import act, login

pytestmark = pytest.mark.django_db


def test_every_stuck_cause_has_a_recommended_action_or_says_what_to_do_instead():
    for cause in stuck_causes(datetime.now(UTC)):
        assert cause in RECOMMENDED, f"stuck cause {cause!r} has no entry in recovery.actions.RECOMMENDED"
        assert RECOMMENDED[cause] or cause in NO_RUN_ACTION, f"{cause!r}: no action, and no sentence instead"
        assert all(name in ACTIONS for name in RECOMMENDED[cause])
    assert {"no_executor", "agent_stopped"} <= set(RECOMMENDED)
    assert RECOMMENDED["no_executor"] == () and "start an executor" in NO_RUN_ACTION["no_executor"]


def test_every_action_says_what_it_does_and_sends_and_its_command_line_parses_as_recover_does():
    parser = Recover().create_parser("manage.py", "recover")
    for name, spec in ACTIONS.items():
        assert spec.does and spec.sends, name
        line = command_line(name, "order:t:1", step="create_task", username="olga", to_version=2)
        args = parser.parse_args(shlex.split(line)[2:])
        assert (args.action, args.workflow_id, args.username, args.reason) == (name, "order:t:1", "olga", "<reason>")
        assert args.step == "create_task"
        assert (args.remote_ref == "<remote id>") == spec.evidence
        assert (args.to_version == "2") == spec.version


def page(client, run) -> str:
    return client.get(reverse("console:run", args=[run.workflow_id])).content.decode()


def items(html: str) -> list[str]:
    """The action items in the order shown (data-item)."""
    return re.findall(r'class="action-item[^"]*" data-item="([^"]+)"', html)


def folded(html: str) -> str:
    """What is under "More actions"."""
    found = re.search(r'<details class="more-actions"[^>]*>(.*?)</details>', html, re.S)
    return found.group(1) if found else ""


@pytest.mark.parametrize(
    "make, cause, recommended, says",
    [
        ("unknown", "unknown", "reconcile:notify", "sends nothing: it looks notify up by its key"),
        ("exhausted", "exhausted", "retry:post_entry", "sends the same request again under the same key"),
        ("failed_with_effects", "failed_with_effects", "compensate", "undoes every completed effect of the run"),
        ("compensation_failed", "compensation_failed", "compensate", "latest first"),
    ],
)
def test_the_recommended_action_is_first_highlighted_and_said_the_rest_under_more(
    clock, monkeypatch, make, cause, recommended, says
):
    builder = getattr(stuck, make)
    run = builder(clock, monkeypatch) if make == "unknown" else builder(clock)
    assert recommend.causes_of(run, engine_clock.now())[0] == cause
    html = page(login("supervisor"), run)

    assert f'data-advice="{cause}"' in html and f'data-recommended="{recommended}"' in html
    shown = items(html)
    assert shown[0] == recommended
    first = html[html.index(f'data-item="{recommended}"') :]
    assert 'class="primary"' in first[: first.index("</form>")]
    assert says in unescape(first[: first.index("</div>")])
    assert f'data-item="{recommended}"' not in folded(html)
    assert all(f'data-item="{other}"' in folded(html) for other in shown[1:])
    assert "<summary>More actions" in html and '<details class="more-actions">' in html  # folded


def test_a_refused_policy_recommends_changing_the_decision_and_an_operator_reads_who_can(clock):
    run = stuck.policy_refused(clock)
    html = unescape(page(login("operator"), run))
    assert 'data-recommended="supersede:decide"' in html
    assert "A supervisor can change the decision decide" in html
    assert 'class="primary"' not in html[html.index('<section class="actions"') : html.index("</section>")]

    html = unescape(page(login("supervisor"), run))
    assert "Change the decision decide: it replaces the model's decision" in html
    assert 'href="#decision-decide"' in html
    assert "manage.py recover supersede policy:t:refused --step decide --decision-file '<decision.json>'" in html


def test_a_run_that_failed_with_nothing_written_recommends_retrying_its_step(clock):
    """Not a stuck cause (nothing is wrong with what exists), but a person must act: retry the step
    once its cause is fixed (or resume, or terminate), first among the buttons."""
    receivers.arm("task", "forbidden")
    run = stuck.start(clock, "early")
    assert run.state == RunState.FAILED and recommend.causes_of(run, engine_clock.now()) == []
    html = page(login("supervisor"), run)
    assert 'data-advice="failed"' in html and 'data-recommended="retry:create_task"' in html
    assert items(html)[0] == "retry:create_task"
    assert "Recommended</b> for this run (failed, nothing written elsewhere)" in unescape(html)


def test_a_run_that_is_not_stuck_has_no_recommendation_and_its_actions_stay_open(clock):
    run = stuck.start(clock, "fine")
    WorkflowRun.objects.filter(pk=run.pk).update(state=RunState.WAITING)  # not stuck: nothing recommended
    html = page(login("supervisor"), run)
    assert "data-advice" not in html and "Recommended" not in html
    assert '<details class="more-actions" open>' in html


def test_each_command_line_shown_performs_what_the_button_does(clock, monkeypatch):
    by_button = stuck.unknown(clock, monkeypatch, "by-button")
    by_command = stuck.unknown(clock, monkeypatch, "by-command")
    client = login("operator")
    assert act(client, by_button, "reconcile", step="notify").status_code == 200

    html = unescape(page(client, by_command))
    line = re.search(r"<code data-command>(manage\.py recover reconcile .+?)</code>", html).group(1)
    args = [a.replace("<reason>", "checked with the team") for a in shlex.split(line)[1:]]
    call_command(*args)

    for run in (by_button, by_command):
        run.refresh_from_db()
    assert by_command.state == by_button.state
    notify = {r.pk: r.steps.get(step_name="notify") for r in (by_button, by_command)}
    assert notify[by_command.pk].state == notify[by_button.pk].state
    actions = [list(AuditEvent.objects.filter(run=r).values_list("action", flat=True)) for r in (by_button, by_command)]
    assert actions[0] == actions[1]
    assert AuditEvent.objects.filter(run=by_command, action="reconcile", actor="u-operator").exists()


def test_it_did_not_happen_asks_first_saying_what_may_be_duplicated(clock, monkeypatch):
    run = stuck.unknown(clock, monkeypatch)
    html = unescape(page(login("supervisor"), run))
    item = html[html.index('data-item="resolve_absent:notify"') :]
    form = item[: item.index("</form>")]
    assert 'hx-confirm="Declare that notify did not happen?' in form
    assert "a message to the approver (notify) may happen a second time" in form
    assert '<input type="hidden" name="confirm" value="ask">' in form
    assert 'hx-vals=\'{"confirmed": "yes"}\'' in form
    reconcile = html[html.index('data-item="reconcile:notify"') :]
    assert "hx-confirm" not in reconcile[: reconcile.index("</form>")]  # a look-up sends nothing: no question


def test_without_javascript_the_question_is_a_page_and_only_yes_performs_it(clock, monkeypatch):
    run = stuck.unknown(clock, monkeypatch)
    client = login("supervisor")
    asked = act(client, run, "resolve_absent", step="notify", htmx=False, confirm="ask")
    assert asked.status_code == 200
    assert "may happen a second time" in unescape(asked.content.decode())
    assert '<input type="hidden" name="confirmed" value="yes">' in asked.content.decode()
    assert run.steps.get(step_name="notify").state == StepState.UNKNOWN  # nothing done yet
    assert not AuditEvent.objects.filter(run=run, action="resolve").exists()

    done = act(client, run, "resolve_absent", step="notify", htmx=False, confirm="ask", confirmed="yes")
    assert done.status_code == 302
    assert run.steps.get(step_name="notify").state != StepState.UNKNOWN


def test_show_run_prints_the_recommended_action_and_its_command_line(clock, monkeypatch, capsys):
    run = stuck.unknown(clock, monkeypatch)
    call_command("show_run", run.workflow_id)
    out = capsys.readouterr().out
    assert "recommended: unknown outcome: reconcile notify; it asks the receiver" in out
    assert f"manage.py recover reconcile {run.workflow_id} --step notify --reason '<reason>' --as '<you>'" in out
