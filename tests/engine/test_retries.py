"""Rule 9: per-step retry policies are bounded."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from recovery.errors import ErrorKind, PermanentError, RateLimited, TransientError, UnclassifiedError, UnknownOutcome
from recovery.retries import RetryPolicy

policies = st.builds(
    lambda initial, coeff, extra, attempts, elapsed, jitter: RetryPolicy(
        initial_interval=initial,
        backoff_coefficient=coeff,
        maximum_interval=initial + extra,
        maximum_attempts=attempts,
        maximum_elapsed=elapsed,
        jitter=jitter,
    ),
    st.floats(0, 100),
    st.floats(1, 10),
    st.floats(0, 1000),
    st.integers(1, 50),
    st.floats(1, 100000),
    st.floats(0, 0.99),
)


@given(policies, st.integers(1, 60), st.floats(0, 1), st.floats(0, 100000))
def test_delay_stays_within_jittered_max_interval_and_budgets(policy, attempt, rand, elapsed):
    delay = policy.next_delay(attempt, TransientError("x"), elapsed=elapsed, rand=rand)
    if attempt >= policy.maximum_attempts:
        assert delay is None
    if delay is not None:
        assert 0 <= delay <= policy.maximum_interval * (1 + policy.jitter) + 1e-9
        assert elapsed + delay <= policy.maximum_elapsed


@given(policies, st.integers(1, 60), st.floats(0, 1))
def test_jitter_stays_within_its_range(policy, attempt, rand):
    base = min(policy.maximum_interval, policy.initial_interval * policy.backoff_coefficient ** (attempt - 1))
    delay = policy.backoff(attempt, rand)
    assert base * (1 - policy.jitter) - 1e-9 <= delay <= base * (1 + policy.jitter) + 1e-9


@given(policies, st.integers(1, 60), st.floats(0, 3600), st.floats(0, 1))
def test_retry_after_is_a_lower_bound(policy, attempt, retry_after, rand):
    delay = policy.next_delay(attempt, RateLimited("429", retry_after=retry_after), rand=rand)
    if delay is not None:
        assert delay >= retry_after


@given(policies, st.integers(1, 60))
def test_only_transient_and_rate_limited_errors_retry(policy, attempt):
    for error in (PermanentError("x"), UnknownOutcome("x"), UnclassifiedError("x")):
        assert policy.next_delay(attempt, error) is None


@given(policies)
def test_every_schedule_ends(policy):
    attempt, elapsed = 1, 0.0
    while (delay := policy.next_delay(attempt, TransientError("x"), elapsed=elapsed, rand=0.5)) is not None:
        attempt, elapsed = attempt + 1, elapsed + delay
    assert attempt <= policy.maximum_attempts


def test_non_retryable_kinds_stop_at_once():
    policy = RetryPolicy(non_retryable_kinds={ErrorKind.RATE_LIMITED})
    assert policy.next_delay(1, RateLimited("429", retry_after=1)) is None
    assert policy.next_delay(1, TransientError("503")) is not None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"backoff_coefficient": 0.5},
        {"initial_interval": 10, "maximum_interval": 1},
        {"maximum_attempts": 0},
        {"maximum_elapsed": 0},
        {"jitter": 1.5},
        {"initial_interval": -1},
    ],
)
def test_invalid_policies_are_refused(kwargs):
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def test_backoff_grows_by_the_coefficient_up_to_the_maximum():
    policy = RetryPolicy(initial_interval=1, backoff_coefficient=2, maximum_interval=5, jitter=0, maximum_attempts=10)
    assert [policy.backoff(n) for n in range(1, 6)] == [1, 2, 4, 5, 5]
