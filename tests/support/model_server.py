"""A local OpenAI-compatible chat-completions server (the ``stub`` fixture) and the replies
the model-provider tests script on it."""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from workflows.integrations.openai import OpenAIClient
from workflows.invoice.model import OpenAIProvider

API_KEY = "sk-test-PLANTED-SECRET-7f3a9c1e"


VALID_DECISION = {
    "category": "hardware",
    "amount": "1840.00",
    "currency": "EUR",
    "approver": "it-lead@example.com",
    "confidence": 0.92,
    "rationale": "Two laptops for 1840.00 EUR.",
}


@dataclass
class Reply:
    status: int = 200
    body: bytes | str | dict | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


class Stub:
    """A scripted OpenAI-compatible server: replies are taken from ``replies`` in order (the
    last one repeats), or made by ``answer`` from each request's body; every request is recorded."""

    def __init__(self) -> None:
        self.replies: deque[Reply] = deque()
        self.answer: Any = None  # body -> Reply
        self.requests: list[Recorded] = []
        self.release = threading.Event()  # set at shutdown so that a delayed reply stops waiting
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body: Any = json.loads(raw)
                except ValueError:
                    body = raw
                stub.requests.append(Recorded("POST", self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                if stub.answer is not None:
                    reply = stub.answer(body)
                else:
                    reply = (
                        stub.replies.popleft()
                        if len(stub.replies) > 1
                        else (stub.replies[0] if stub.replies else Reply())
                    )
                if reply.delay and stub.release.wait(reply.delay):
                    return  # shutting down: drop the connection
                payload = reply.body
                if isinstance(payload, dict):
                    payload = json.dumps(payload)
                data = payload.encode() if isinstance(payload, str) else (payload or b"")
                try:
                    self.send_response(reply.status)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout test)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's name
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def reply(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    def provider(self, *, api_key: str = API_KEY, timeout: float = 2.0, model: str = "gpt-test") -> OpenAIProvider:
        return OpenAIProvider(base_url=self.base_url, api_key=api_key, model=model, timeout=timeout)

    def client(self, *, api_key: str = API_KEY, timeout: float = 2.0, model: str = "gpt-test") -> OpenAIClient:
        """The shared client (what the dispute agent uses), pointed at this server."""
        return OpenAIClient(base_url=self.base_url, api_key=api_key, model=model, timeout=timeout)


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = Stub()
    thread = threading.Thread(target=server.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.server.shutdown()
        server.server.server_close()
        thread.join(timeout=2)


def function_calling(body: Any) -> Reply:
    """An OpenAI-compatible model with function calling, for the dispute workflow: the offline
    rules agent's reply to the conversation it is sent, as a chat completion."""
    from workflows.dispute.agent import RulesAgent

    if not isinstance(body, dict) or not body.get("tools"):
        return Reply(status=400, body={"error": {"message": "expected messages and tools"}})
    message = RulesAgent().chat(messages=body["messages"], tools=body["tools"], about="stub")
    return Reply(body={**completion(message.get("content")), "choices": [{"index": 0, "message": message}]})


def completion(content: str | None, *, refusal: str | None = None) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if refusal is not None:
        message["refusal"] = refusal
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "gpt-test",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
    }
