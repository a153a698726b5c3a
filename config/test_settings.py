"""Settings for the test suite: the production settings plus the test workflows."""

import os

os.environ.setdefault("RECOVERY_LEASE_SECONDS", "5")

from .settings import *  # noqa: E402,F403
from .settings import (  # noqa: E402
    DATABASES,
    INSTALLED_APPS,
    RECOVERY_WORKFLOW_MODULES,
    SILENCED_SYSTEM_CHECKS,
    VAR_DIR,
)

INSTALLED_APPS = [*INSTALLED_APPS, "tests.support"]
# The test workflows; a process started by a test may leave one out (RECOVERY_TEST_WORKFLOW_MODULES:
# a deploy that dropped test_versioned v1, say).
RECOVERY_WORKFLOW_MODULES = [
    *RECOVERY_WORKFLOW_MODULES,
    *os.environ.get(
        "RECOVERY_TEST_WORKFLOW_MODULES",
        "tests.support.workflows,tests.support.waits,tests.support.versioned,tests.support.versioned_v1",
    ).split(","),
]
# The engine's test workflows act on their decisions unguarded on purpose (test_policy is the
# guarded one): their warning would print on every command the tests run.
SILENCED_SYSTEM_CHECKS = [*SILENCED_SYSTEM_CHECKS, "recovery.W001"]
RECOVERY_LEASE_SECONDS = float(os.environ["RECOVERY_LEASE_SECONDS"])
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # A file, not :memory:, so that a subprocess (the crash tests) sees the same database.
    # Per process, so that two test runs on one machine never share a file.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / f"test-recovery-{os.getpid()}.sqlite3")}
if DATABASES["sandbox"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["sandbox"]["TEST"] = {"NAME": str(VAR_DIR / f"test-sandbox-{os.getpid()}.sqlite3")}
for config in DATABASES.values():
    if config["ENGINE"] == "django.db.backends.postgresql":
        config["TEST"] = {"NAME": f"test_{config['NAME']}_{os.getpid()}"}
RECOVERY_HTTP_TIMEOUT = 1.0
# The demo (/demo, seed_demo) is on in the tests, as under make run; tests of it being off turn it off.
RECOVERY_DEMO = True
# /metrics is on in the tests (a scraper presents this token); tests of it being off unset it.
RECOVERY_METRICS_TOKEN = "test-metrics-token-0123456789"
