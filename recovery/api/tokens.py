"""API tokens for the event ingestion API.

A token is ``rc_`` + ``secrets.token_urlsafe(32)``, shown once when it is issued. Only its
sha256 is stored, so a copy of the database lets nobody start runs; a presented token is
hashed and looked up by that hash. Each token may start runs of exactly one workflow.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import datetime

from django.db import IntegrityError, transaction
from django.utils import timezone

from recovery.models import ApiToken
from recovery.workflow import get_workflow

TOKEN_PREFIX = "rc_"
MAX_TOKEN_LENGTH = 200  # anything longer is not one of ours: refused without a query


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def issue_token(
    *, name: str, workflow_name: str, may_pause: bool = False, may_decide: bool = False, now: datetime | None = None
) -> tuple[ApiToken, str]:
    """Create a token that may start runs of ``workflow_name`` (and, ``may_pause``, pause and
    release it; ``may_decide``, decide its held tool calls for the people it names) and return it
    with the token itself, which is not stored and cannot be shown again. Raises LookupError for
    an unknown workflow and ValueError for an empty or taken name; writes nothing then."""
    name = name.strip()
    if not name:
        raise ValueError("a token needs a name")
    workflow = get_workflow(workflow_name)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    try:
        with transaction.atomic():
            row = ApiToken.objects.create(
                name=name,
                token_hash=hash_token(token),
                prefix=token[:8],
                workflow_name=workflow.name,
                may_pause=may_pause,
                may_decide=may_decide,
                created_at=now or timezone.now(),
            )
    except IntegrityError:
        raise ValueError(f"a token named {name!r} already exists; choose another name") from None
    return row, token


def revoke_token(*, name: str, now: datetime | None = None) -> ApiToken:
    """Revoke the token called ``name`` for good (a revoked token is refused like an unknown
    one). Revoking it again changes nothing. Raises ApiToken.DoesNotExist."""
    with transaction.atomic():
        row = ApiToken.objects.select_for_update().get(name=name)
        if row.revoked_at is None:
            row.revoked_at = now or timezone.now()
            row.save(update_fields=["revoked_at"])
        return row


def authenticate(token: str | None, *, now: datetime | None = None) -> ApiToken | None:
    """The active (not revoked) token ``token`` is, or None; records when it was last used."""
    if not token or not token.startswith(TOKEN_PREFIX) or len(token) > MAX_TOKEN_LENGTH:
        return None
    digest = hash_token(token)
    row = ApiToken.objects.filter(token_hash=digest, revoked_at__isnull=True).first()
    if row is None or not hmac.compare_digest(row.token_hash, digest):
        return None
    row.last_used_at = now or timezone.now()
    ApiToken.objects.filter(pk=row.pk).update(last_used_at=row.last_used_at)
    return row


def may_start(token: ApiToken, workflow_name: str) -> bool:
    return token.workflow_name == workflow_name


def may_decide(token: ApiToken, workflow_name: str) -> bool:
    """Whether the token may decide ``workflow_name``'s held tool calls for a named person (a chat
    bot's): never a token that only starts runs — the system sending invoices does not approve them."""
    return token.may_decide and token.workflow_name == workflow_name


def may_pause(token: ApiToken, workflow_name: str) -> bool:
    return token.may_pause and token.workflow_name == workflow_name


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None
