"""The invoice workflow's oldest definition, v1: the same steps, guards and settings as v2
(``v2.py``) but without ``check_duplicate``. Kept until the v1 runs have drained (each run executes to the
end on the version it started on); remove this module, and its import in
``workflows/registry.py``, once no run of invoice v1 is left unfinished."""

from .workflow import invoice

invoice_v1 = invoice.derive(version=1, without=["check_duplicate", "watch_approval_task", "approver_decision"])
