from django.db import models


class RemoteObject(models.Model):
    """What a counting receiver created: one row per remote object (task, message, ledger
    entry) or per model call. Written in the receiver's own transaction, so it survives a
    worker crash exactly as an object in another system would."""

    kind = models.CharField(max_length=20)
    dedupe_key = models.CharField(max_length=128, null=True)  # set only by receivers that dedupe
    client_ref = models.CharField(max_length=128, blank=True)
    payload = models.JSONField(default=dict)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["kind", "dedupe_key"], name="receiver_keeps_first_result")]
