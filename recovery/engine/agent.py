"""An agent step's journal: the rows of its model turns and tool calls, read back as the
conversation the next turn is asked with, and a model's reply read into the calls it asks for.

Pure: it reads rows and declarations and writes nothing (the transitions ``agent_turn_add`` and
``agent_turn_record`` write the journal; the executor drives the loop).

A turn's row holds the model's reply (``result``: its text, the calls it asked for with their
ids and arguments, and the final answer once there is one). A call's row holds the validated
arguments as its intent and the tool's outcome as any step's. The conversation is rebuilt from
those rows alone, in their order, so that a resumed run asks the next turn exactly as the run
that crashed would have.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pydantic

from recovery.errors import InvalidModelOutput
from recovery.models import StepExecution, StepState
from recovery.validation import problem_text, problems_of
from recovery.workflow import (
    AgentContext,
    AgentPolicy,
    StepContext,
    call_name,
    parse_journal_name,
)

from .transitions.tables import DONE_STEP_STATES

ARGUMENTS_INVALID = "invalid arguments"  # the start of a skipped call's error: counted against the budget


@dataclass(frozen=True)
class NewCall:
    """A tool call a journaled turn asked for, as its row is written: ``error`` set when it
    is answered to the model without being made (no such tool, invalid arguments)."""

    name: str
    tool: str
    arguments: dict[str, Any]
    error: str = ""


@dataclass(frozen=True)
class Reply:
    """A model turn's reply, as its row's result keeps it."""

    content: str
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"id", "name", "arguments"}
    final: dict[str, Any] | None = None

    def as_result(self) -> dict[str, Any]:
        return {"content": self.content, "tool_calls": self.calls, "final": self.final}


def is_turn(step: StepExecution) -> bool:
    return parse_journal_name(step.step_name).tool is None


def turns(rows: list[StepExecution]) -> list[StepExecution]:
    return [row for row in rows if is_turn(row)]


def invalid_calls(rows: list[StepExecution]) -> int:
    """Calls answered to the model as errors because of their arguments or tool name, in the
    turns still in the conversation: those of the turns a fork left out no longer count, as the
    turns themselves no longer count against ``max_turns``."""
    left_out = {parse_journal_name(row.step_name).turn for row in turns(rows) if row.state == StepState.SKIPPED}
    return sum(
        1
        for row in rows
        if row.state == StepState.SKIPPED
        and row.last_error.startswith(ARGUMENTS_INVALID)
        and parse_journal_name(row.step_name).turn not in left_out
    )


def waiting(rows: list[StepExecution]) -> StepExecution | None:
    """The first journal row not done yet: the executor acts on it before anything else."""
    return next((row for row in rows if row.state not in DONE_STEP_STATES), None)


def next_turn(name: str, policy: AgentPolicy, rows: list[StepExecution]) -> tuple[int, str]:
    """Once every row of agent ``name``'s journal is done: the number of the turn to add next,
    or 0 and why an operator must decide instead (a budget spent)."""
    turns_ = turns(rows)
    asked = sum(1 for turn in turns_ if turn.state != StepState.SKIPPED)  # a fork's left-out turns are not counted
    invalid = invalid_calls(rows)
    if invalid > policy.argument_errors:
        budget = policy.argument_errors
        return 0, f"{name}: the model asked for {invalid} tool call(s) with invalid arguments (budget {budget})"
    if asked >= policy.max_turns:
        return 0, f"{name}: no final answer after {asked} model turn(s)"
    return max((parse_journal_name(turn.step_name).turn for turn in turns_), default=0) + 1, ""


def context(policy: AgentPolicy, base: StepContext, rows: list[StepExecution], turn: int) -> AgentContext:
    """What the function of turn ``turn`` is asked with: the conversation of the turns before it."""
    earlier = [row for row in rows if parse_journal_name(row.step_name).turn < turn]
    return AgentContext(**vars(base), messages=conversation(earlier), tools=policy.definitions(), turn=turn)


def conversation(rows: list[StepExecution]) -> list[dict[str, Any]]:
    """OpenAI-style messages: each journaled turn as the assistant's message with its tool
    calls, then one tool message per call with its result — or the error, the refusal, or
    the fact that it was not made."""
    messages: list[dict[str, Any]] = []
    by_name = {row.step_name: row for row in rows}
    for row in rows:
        if not is_turn(row) or row.state != StepState.SUCCEEDED or not row.result:
            continue
        reply = row.result
        turn = parse_journal_name(row.step_name)
        calls = reply.get("tool_calls") or []
        message: dict[str, Any] = {"role": "assistant", "content": reply.get("content") or None}
        if calls:
            message["tool_calls"] = [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], sort_keys=True)},
                }
                for call in calls
            ]
        messages.append(message)
        for index, call in enumerate(calls):
            made = by_name.get(call_name(turn.agent, turn.turn, index, _row_tool(call["name"])))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": _answer(made)})
    return messages


def _answer(row: StepExecution | None) -> str:
    if row is None:
        return json.dumps({"error": "not made"})
    if row.state == StepState.SUCCEEDED:
        return json.dumps({"remote_ref": row.remote_ref, "result": row.result}, sort_keys=True, default=str)
    if row.refusal:
        refusal = row.refusal
        return json.dumps({"error": f"refused by policy {refusal.get('rule')}: {refusal.get('message')}"})
    return json.dumps({"error": row.last_error or row.state})


def read_reply(policy: AgentPolicy, raw: Any, turn: int) -> Reply:
    """The model's reply as the journal keeps it. A reply with no tool call is the final
    answer, which must match the agent's schema (else ``InvalidModelOutput``: a format
    failure, counted against the step's budget, and the turn is asked again)."""
    text = raw if isinstance(raw, str) else json.dumps(raw, default=str)
    message = _message(raw, text)
    content = message.get("content") or ""
    if not isinstance(content, str):
        raise InvalidModelOutput("model reply: content must be text", raw_output=text)
    asked = message.get("tool_calls") or []
    if not isinstance(asked, list):
        raise InvalidModelOutput("model reply: tool_calls must be a list", raw_output=text)
    calls = [_call(item, index, turn, text) for index, item in enumerate(asked)]
    if calls:
        return Reply(content=content, calls=calls)
    try:
        final = policy.schema.model_validate(json.loads(content)).model_dump(mode="json")
    except (ValueError, pydantic.ValidationError) as exc:
        message = problem_text(f"final answer does not match {policy.schema.__name__}", problems_of(exc))
        raise InvalidModelOutput(message, raw_output=text) from exc
    return Reply(content=content, final=final)


def _message(raw: Any, text: str) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError:
            return {"content": raw}
        return parsed if isinstance(parsed, dict) and ("tool_calls" in parsed or "role" in parsed) else {"content": raw}
    if isinstance(raw, dict):
        return raw
    raise InvalidModelOutput(f"model reply: expected a message or text, got {type(raw).__name__}", raw_output=text)


def _call(item: Any, index: int, turn: int, text: str) -> dict[str, Any]:
    """One requested call as ``{"id", "name", "arguments"}`` (OpenAI's ``function`` wrapper or a
    flat ``name``/``arguments``). Arguments that are not a JSON object are kept as they came:
    the call is then answered as an error, not made."""
    if not isinstance(item, dict):
        raise InvalidModelOutput("model reply: a tool call must be an object", raw_output=text)
    function = item.get("function") if isinstance(item.get("function"), dict) else item
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidModelOutput("model reply: a tool call has no name", raw_output=text)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            arguments = {"unparsed": arguments}
    call_id = item.get("id") if isinstance(item.get("id"), str) and item.get("id") else f"call_{turn}_{index}"
    return {"id": call_id[:64], "name": name[:64], "arguments": arguments}


def new_calls(policy: AgentPolicy, agent: str, turn: int, reply: Reply) -> list[NewCall]:
    """The rows a journaled turn's calls get: each validated against its tool's arguments."""
    made = []
    for index, call in enumerate(reply.calls):
        tool = policy.tools.get(call["name"])
        name = call_name(agent, turn, index, _row_tool(call["name"]))
        arguments = call["arguments"]
        if tool is None:
            error = f"{ARGUMENTS_INVALID}: no tool named {call['name']!r} (tools: {', '.join(policy.tools)})"
        elif not isinstance(arguments, dict):
            error = f"{ARGUMENTS_INVALID}: arguments must be a JSON object"
        else:
            assert tool.arguments is not None
            try:
                arguments = tool.arguments.model_validate(arguments).model_dump(mode="json")
                error = ""
            except pydantic.ValidationError as exc:
                error = f"{ARGUMENTS_INVALID} for {call['name']}: {exc}"
        made.append(
            NewCall(
                name=name,
                tool=call["name"],
                arguments=arguments if isinstance(arguments, dict) else {"value": arguments},
                error=error[:2000],
            )
        )
    return made


def _row_tool(name: str) -> str:
    """A requested tool's name as it may stand in a row's name (a made-up name included)."""
    cleaned = "".join(c if c.isalnum() or c in "_-" else "_" for c in name)
    return cleaned[:40] or "_"
