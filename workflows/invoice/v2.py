"""The invoice workflow's previous definition, v2: the same steps, guards and settings as v3 but
without the approver's decision (``watch_approval_task``, ``approver_decision``): it posts once the
approver is notified. Kept until the v2 runs have drained (each run executes to the end on the
version it started on); remove this module, and its import in ``workflows/registry.py``, once no
run of invoice v2 is left unfinished."""

from .workflow import invoice

invoice_v2 = invoice.derive(version=2, without=["watch_approval_task", "approver_decision"])
