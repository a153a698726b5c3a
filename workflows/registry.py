"""Imported at start-up (settings.RECOVERY_WORKFLOW_MODULES): import every module that
declares a workflow here, so that the executor and ``manage.py check`` know it."""

from workflows.dispute import workflow as dispute  # noqa: F401
from workflows.invoice import workflow as invoice  # noqa: F401
