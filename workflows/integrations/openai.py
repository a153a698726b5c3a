"""An OpenAI-compatible chat-completions client, for any workflow's model step.

:class:`OpenAIClient` sends one request to ``{base_url}/chat/completions`` of any compatible
server: :meth:`~OpenAIClient.complete` a body its caller built (the invoice workflow asks for
strict structured output) and returns the reply's content; :meth:`~OpenAIClient.chat` one turn
of a conversation with function calling (the dispute workflow's agent) and returns the
assistant's message. :meth:`OpenAIClient.from_settings` builds it from ``OPENAI_BASE_URL``,
``OPENAI_API_KEY``, ``OPENAI_MODEL`` and ``OPENAI_TIMEOUT``; :func:`call_timeout` is the model
call's timeout with the configured ``MODEL_PROVIDER``.

Invariants: one POST per call. Transport and protocol failures are classified once, here, into
``recovery.errors`` (:func:`classify_openai_error`). The API key is sent only in the
Authorization header and never appears in an exception message, a log line, a ``repr`` or a
returned value.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import ssl
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Self

import httpx
from django.conf import settings

from recovery.errors import (
    InvalidModelOutput,
    PermanentError,
    RateLimited,
    StepError,
    TransientError,
    UnclassifiedError,
)
from recovery.redaction import redact_text

logger = logging.getLogger(__name__)

#: Statuses after which the same request may succeed later (429 is classified on its own).
RETRYABLE_STATUSES = frozenset({408, 409, 500, 502, 503, 504})

#: Raw provider bodies kept on an InvalidModelOutput are cut to this many characters.
RAW_OUTPUT_LIMIT = 20_000


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One verifying TLS context for every call (building one costs tens of milliseconds)."""
    return httpx.create_ssl_context()


def _redact(text: str, secret: str) -> str:
    """``text`` without the key, nor any other credential recovery.redaction knows."""
    return redact_text(text.replace(secret, "[redacted]") if secret else text)


def parse_retry_after(headers: httpx.Headers, *, now: datetime | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``Retry-After`` (seconds or an HTTP date);
    None when absent or unreadable. Never negative."""
    millis = headers.get("retry-after-ms")
    if millis:
        try:
            value = float(millis) / 1000
            if math.isfinite(value) and value >= 0:
                return value
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if not raw:
        return None
    raw = raw.strip()
    try:
        value = float(raw)
    except ValueError:
        try:
            when = parsedate_to_datetime(raw)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())
    return value if math.isfinite(value) and value >= 0 else None


def _error_detail(response: httpx.Response, secret: str) -> str:
    """The provider's own error message (OpenAI: ``{"error": {"message": …}}``), else the
    start of the body; redacted before it is cut (a cut key would no longer be recognised)."""
    try:
        payload = json.loads(response.content)
        message = payload["error"]["message"] if isinstance(payload.get("error"), dict) else payload["error"]
        if message:
            return _redact(str(message), secret)[:300]
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return _redact(response.text, secret)[:300]


def classify_openai_error(exc: BaseException, *, secret: str = "") -> StepError:
    """Classify a failure of a chat-completions call, once, at the provider boundary.

    - timeouts, refused connections and other transport errors → TransientError (a model
      call has no external effect beyond usage, so a repeat is safe);
    - 429 → RateLimited with Retry-After; 408/409/5xx → TransientError;
    - 401/403 (authorisation), 400/404/422 (bad request, unknown model), other 4xx and
      unexpected redirects → PermanentError; an unsupported scheme or invalid URL → PermanentError.

    Invariant: ``secret`` (the API key) never appears in the returned error's message.
    """
    if isinstance(exc, httpx.HTTPStatusError):
        response = exc.response
        status = response.status_code
        detail = _error_detail(response, secret)
        summary = f"{status} {response.reason_phrase}".strip()
        if status == 429:
            error: StepError = RateLimited(
                f"model provider rate limited ({summary}): {detail}", retry_after=parse_retry_after(response.headers)
            )
        elif status in RETRYABLE_STATUSES or status >= 500:
            error = TransientError(f"model provider unavailable ({summary}): {detail}")
        elif status in (401, 403):
            error = PermanentError(f"model provider refused authorisation ({summary}): {detail}")
        elif 300 <= status < 400:
            error = PermanentError(f"model provider redirected ({summary}): check OPENAI_BASE_URL")
        else:
            error = PermanentError(f"model provider rejected the request ({summary}): {detail}")
    elif isinstance(exc, httpx.TimeoutException):
        error = TransientError(f"model provider timed out ({type(exc).__name__})")
    elif isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL | httpx.TooManyRedirects):
        error = PermanentError(f"model provider URL unusable ({type(exc).__name__}): {_redact(str(exc), secret)}")
    elif isinstance(exc, httpx.TransportError | httpx.DecodingError):
        error = TransientError(f"model provider unreachable ({type(exc).__name__}): {_redact(str(exc), secret)}")
    elif isinstance(exc, StepError):
        return exc
    else:
        error = UnclassifiedError(f"model provider call failed ({type(exc).__name__}): {_redact(str(exc), secret)}")
    error.__cause__ = exc
    return error


def _message_of(response: httpx.Response, *, secret: str) -> dict[str, Any]:
    """``choices[0].message`` of a 2xx reply; a refusal is permanent, anything else unreadable
    is an invalid model output carrying the (redacted, truncated) body."""
    raw = _redact(response.text, secret)[:RAW_OUTPUT_LIMIT]
    try:
        payload = json.loads(response.content)
    except ValueError as exc:
        raise InvalidModelOutput(
            f"model provider answered {response.status_code} with a body that is not JSON", raw_output=raw
        ) from exc
    try:
        message = payload["choices"][0]["message"]
        if not isinstance(message, dict):
            raise TypeError("message is not an object")
    except (KeyError, IndexError, TypeError) as exc:
        raise InvalidModelOutput("model provider reply has no choices[0].message", raw_output=raw) from exc
    refusal = message.get("refusal")
    if refusal:
        raise PermanentError(f"model refused: {_redact(str(refusal), secret)[:500]}")
    return message


def _content_of(response: httpx.Response, *, secret: str) -> str:
    """``choices[0].message.content`` of a 2xx reply (see ``_message_of``)."""
    raw = _redact(response.text, secret)[:RAW_OUTPUT_LIMIT]
    message = _message_of(response, secret=secret)
    content = message.get("content")
    if not isinstance(content, str):
        raise InvalidModelOutput("model provider reply has no choices[0].message.content", raw_output=raw)
    # Only a realistic key is redacted from content: a very short one would mangle the JSON.
    return _redact(content, secret) if len(secret) >= 8 else content


@dataclass(frozen=True, kw_only=True)
class OpenAIClient:
    """An OpenAI-compatible chat-completions client.

    Invariants: one POST per ``complete`` or ``chat``; failures leave as classified
    ``StepError``s raised from the original exception; the API key is sent only in the
    Authorization header and is never in an error, a log line, ``repr`` or the returned value.
    """

    base_url: str
    api_key: str = field(repr=False)
    model: str
    timeout: float
    transport: httpx.BaseTransport | None = field(default=None, repr=False, compare=False)
    name: str = field(default="openai", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))
        if not self.timeout > 0:
            raise ValueError("timeout must be a positive number of seconds")

    @classmethod
    def from_settings(cls) -> Self:
        """The client ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``OPENAI_MODEL`` and
        ``OPENAI_TIMEOUT`` configure (read at call time)."""
        return cls(
            base_url=getattr(settings, "OPENAI_BASE_URL", "") or "https://api.openai.com/v1",
            api_key=getattr(settings, "OPENAI_API_KEY", "") or "",
            model=getattr(settings, "OPENAI_MODEL", "") or "gpt-4o-mini",
            timeout=float(getattr(settings, "OPENAI_TIMEOUT", 30) or 30),
        )

    @property
    def url(self) -> str:
        return f"{self.base_url}/chat/completions"

    def http_timeout(self) -> httpx.Timeout:
        """Connect within at most 5 s; read (and write, pool) within ``timeout``."""
        return httpx.Timeout(self.timeout, connect=min(5.0, self.timeout))

    def complete(self, body: dict[str, Any], *, about: str) -> str:
        """One request with the caller's ``body`` (model, messages, response format…): the
        reply's ``choices[0].message.content``, as text. ``about`` names the call in the log
        (e.g. ``invoice_id=inv-1``)."""
        return self._post(body, _content_of, about)

    def chat(self, *, messages: list[dict[str, Any]], tools: list[dict[str, Any]], about: str) -> dict[str, Any]:
        """One turn of a conversation with function calling: the assistant's message (its
        ``content`` and its ``tool_calls``), as the provider returned it. ``about`` names the
        conversation in the log (e.g. ``dispute_id=d-1``)."""
        body = {"model": self.model, "temperature": 0, "messages": messages, "tools": tools, "tool_choice": "auto"}
        return self._post(body, _message_of, about)

    def _post(self, body: dict[str, Any], read: Any, about: str) -> Any:
        """One POST; failures leave as classified ``StepError``s, logged without the key."""
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        started = time.monotonic()
        try:
            with httpx.Client(
                transport=self.transport, timeout=self.http_timeout(), verify=_ssl_context(), follow_redirects=False
            ) as client:
                response = client.post(self.url, json=body, headers=headers)
                response.raise_for_status()
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            error = classify_openai_error(exc, secret=self.api_key)
            logger.warning("model call failed %s model=%s kind=%s error=%s", about, self.model, error.kind, error)
            raise error from exc
        elapsed_ms = int((time.monotonic() - started) * 1000)
        try:
            answer = read(response, secret=self.api_key)
        except StepError as error:
            logger.warning("model reply unusable %s model=%s kind=%s error=%s", about, self.model, error.kind, error)
            raise
        logger.info(
            "model call %s model=%s status=%s elapsed_ms=%d", about, self.model, response.status_code, elapsed_ms
        )
        return answer


def call_timeout() -> float:
    """Seconds a model call may take with the configured provider (the offline rules: none)."""
    return float(settings.OPENAI_TIMEOUT) if getattr(settings, "MODEL_PROVIDER", "rules") == "openai" else 0.0
