"""The state labels of the run page and the runs list (recovery.console.labels), for templates:
``{% state_label step run now conversations as st %}`` then ``st.text``, ``st.css``, ``st.next``
and ``st.attempts``; ``{% run_state run as rs %}`` then ``rs.0`` (label) and ``rs.1`` (css);
``{% run_wake run now %}`` the run's next wake-up."""

from django import template

from recovery.console import labels

register = template.Library()


@register.simple_tag
def state_label(step, run, now, conversations=None) -> labels.StateLabel:
    agent = next((c for c in conversations or () if c["step"] == step.step_name), None)
    return labels.step_label(step, run=run, now=now, agent=agent)


@register.simple_tag
def run_wake(run, now) -> str:
    return labels.run_wake(run, now=now)


@register.simple_tag
def run_state(run) -> tuple[str, str]:
    return labels.list_state(run)
