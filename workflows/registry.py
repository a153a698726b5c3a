"""Imported at start-up (settings.RECOVERY_WORKFLOW_MODULES): import every module that
declares a workflow here, so that the executor and ``manage.py check`` know it, with every
version a deployment keeps beside the current one until its runs drain."""

from workflows.dispute import workflow as dispute  # noqa: F401
from workflows.invoice import v1 as invoice_v1  # noqa: F401
from workflows.invoice import v2 as invoice_v2  # noqa: F401
from workflows.invoice import workflow as invoice  # noqa: F401
