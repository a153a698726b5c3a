"""The retry policies the workflows' steps share.

Reads are cheap and safe: retry quickly. Model calls cost money: fewer attempts, and a budget
for outputs that fail the schema. Writes to other systems: patient backoff, bounded in time.
The ledger gets the most care.
"""

from __future__ import annotations

from recovery.retries import RetryPolicy

READ_POLICY = RetryPolicy(initial_interval=1, maximum_interval=10, maximum_attempts=5, maximum_elapsed=300)
MODEL_POLICY = RetryPolicy(
    initial_interval=2, maximum_interval=60, maximum_attempts=4, maximum_elapsed=900, maximum_format_failures=3
)
WRITE_POLICY = RetryPolicy(initial_interval=2, maximum_interval=120, maximum_attempts=6, maximum_elapsed=3600)
LEDGER_POLICY = RetryPolicy(initial_interval=5, maximum_interval=300, maximum_attempts=6, maximum_elapsed=7200)
