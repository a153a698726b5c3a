import pytest

from recovery.engine import failpoints


def test_failpoints_are_inert_unless_armed(monkeypatch):
    monkeypatch.delenv("RECOVERY_FAILPOINTS", raising=False)
    for point in failpoints.POINTS:
        failpoints.hit("create_task", point)


def test_an_armed_raise_fires_only_at_its_step_and_point(monkeypatch):
    monkeypatch.setenv("RECOVERY_FAILPOINTS", "create_task:after_call=raise, notify:before_call=sleep(1)")
    failpoints.hit("create_task", "before_call")
    failpoints.hit("notify", "before_call")
    with pytest.raises(failpoints.FailpointRaised, match="create_task:after_call"):
        failpoints.hit("create_task", "after_call")


@pytest.mark.parametrize(
    "spec", ["create_task:after=crash", "create_task=crash", "x:before_call=explode", "x:before_call=sleep(abc)"]
)
def test_a_malformed_spec_is_refused_with_the_expected_form(monkeypatch, spec):
    monkeypatch.setenv("RECOVERY_FAILPOINTS", spec)
    with pytest.raises(ValueError, match="STEP:POINT=ACTION"):
        failpoints.hit("x", "before_call")
