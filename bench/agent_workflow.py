"""The agent benchmark's workflows (``bench/agent.py``): the same trivial work done K times, as K
plain steps (``bench_plain``) or as K tool calls of one agent step (``bench_agent``), whose scripted
model asks for one call per turn and then answers: K calls and K + 1 model turns.

K is ``BENCH_AGENT_CALLS`` (default 3), read at import. Registered only in the benchmark's
processes, through ``RECOVERY_WORKFLOW_MODULES=workflows.registry,bench.agent_workflow`` (``bench``
is a namespace package, importable because the project root is on ``sys.path``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from recovery.workflow import AgentContext, Rerun, StepContext, Workflow

CALLS = int(os.environ.get("BENCH_AGENT_CALLS", "3"))
if CALLS < 1:
    raise ValueError(f"BENCH_AGENT_CALLS must be at least 1, not {CALLS}")
AGENT = "act"  # the agent step: its journal rows are act:TURN and act:TURN:0:do_work


class BenchInput(BaseModel):
    id: str


class WorkArgs(BaseModel):
    n: int


class Answer(BaseModel):
    calls: int


def work(n: int) -> dict[str, Any]:
    """The trivial work of a plain step and of a tool call alike."""
    return {"n": n}


# --- K plain steps ---------------------------------------------------------------------

plain = Workflow(
    "bench_plain",
    version=1,
    input_schema=BenchInput,
    workflow_id=lambda i: f"bench_plain:{i['id']}",
    description="bench/agent.py: K plain steps",
)


def _plain_step(n: int) -> Callable[[StepContext], dict[str, Any]]:
    def step(ctx: StepContext) -> dict[str, Any]:
        return work(n)

    return step


for _n in range(CALLS):
    plain.step(effect="none", rerun=Rerun.YES, name=f"step{_n}")(_plain_step(_n))


# --- one agent step making K tool calls --------------------------------------------------

agent = Workflow(
    "bench_agent",
    version=1,
    input_schema=BenchInput,
    workflow_id=lambda i: f"bench_agent:{i['id']}",
    description="bench/agent.py: one agent step making K tool calls",
)


@agent.tool(arguments=WorkArgs, effect="none", rerun=Rerun.YES)
def do_work(ctx: StepContext) -> dict[str, Any]:
    """Do the bench's trivial work."""
    return work(ctx.intent["n"])


@agent.agent(tools=[do_work], schema=Answer, max_turns=CALLS + 1, name=AGENT)
def act(ctx: AgentContext) -> dict[str, Any] | str:
    """The scripted model, a pure function of the conversation: one call per turn, then the answer."""
    made = sum(1 for message in ctx.messages if message["role"] == "tool")
    if made >= CALLS:
        return json.dumps({"calls": made})
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call-{made}",
                "type": "function",
                "function": {"name": "do_work", "arguments": json.dumps({"n": made})},
            }
        ],
    }
