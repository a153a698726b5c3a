"""A step's recovery contract: what an author declares of each step (``StepSpec``, a tool's
``ToolSpec``, an agent's ``AgentPolicy``), what a step sees when it runs (``StepContext`` and its
kin), what it returns (``Outcome``), its keys, and the names of an agent's journal rows.
``recovery.workflow`` declares workflows of these steps and re-exports all of it: authors import
from there."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pydantic
from django.conf import settings
from django.db import models

from recovery.retries import RetryPolicy
from recovery.waiting import ToolApproval, WaitSpec


class Rerun(models.TextChoices):
    YES = "yes"
    USUALLY = "usually"
    NO = "no"


class Reconcile(models.TextChoices):
    """How an unknown outcome of this step is resolved."""

    RERUN = "rerun", "re-run: the step has no external effect that a repeat could double"
    LOOKUP = "lookup", "look up the remote object by idempotency key"
    RESEND = "resend", "resend with the same key; the receiver keeps its first result"
    OPERATOR = "operator", "operator review"


class CompensationPolicy(models.TextChoices):
    """What a late permanent failure does to the effects already made. Technical errors
    (unknown outcomes, exhausted retries) never compensate by themselves either way."""

    OPERATOR = "operator", "wait for an operator to decide"
    AUTOMATIC = "automatic", "compensate completed steps at once, in reverse order"


class _Default:
    """The in-flight bound a step gets when it declares none: see ``StepSpec.in_flight_bound``."""

    def __repr__(self) -> str:
        return "DEFAULT_SETTLE"


DEFAULT_SETTLE: Any = _Default()


@dataclass(frozen=True)
class Compensation:
    """The contract of a step's compensation (rule 10)."""

    description: str
    who: str = "supervisor"  # the lowest role that may trigger it by hand
    restores: bool = False  # True only if it truly restores the previous state ("rolled back")


@dataclass(frozen=True)
class Outcome:
    """What a side-effecting call observably produced."""

    remote_ref: str = ""
    result: dict[str, Any] | None = None
    incident: str = ""  # a compensation's note that the run is now an incident (e.g. a correction was sent)
    restored: bool = False  # a compensation that truly restored the previous state


@dataclass(frozen=True)
class StepContext:
    """What a step sees: the run's identity and input, earlier results, its own key and intent."""

    workflow_id: str
    input: dict[str, Any]
    step: str
    idempotency_key: str
    results: dict[str, Any]
    intent: dict[str, Any] | None = None
    # Each step's key version in this run: its declared one, plus one for each restart that made it
    # again (recovery.engine.transitions.restarts). A receiver's own reference for a posting can
    # follow it, so that a posting made again after a restart is a new one (``key_version``).
    key_versions: dict[str, int] = field(default_factory=dict)
    # A wait step's event payload, validated (recovery.waiting): what its function turns into a result.
    event: Any = None

    def result(self, step: str) -> Any:
        return self.results[step]

    def key_version(self, step: str | None = None) -> int:
        """The key version of ``step`` (this step if None) in this run: 1 unless declared otherwise
        or made again by a restart."""
        return self.key_versions.get(step or self.step, 1)


@dataclass(frozen=True)
class GuardContext(StepContext):
    """What a guard sees: the step's context with the intent about to be checkpointed, and
    ``decision``, the accepted decision of the latest model step before it. A guard reads the
    current state of other systems itself (through the workflow's adapters), fresh each time."""

    decision: dict[str, Any] | None = None


@dataclass(frozen=True)
class PauseAfter:
    """``pause_after=PauseAfter(failures=5, within=timedelta(minutes=2))``: when that many attempts
    of a step, across the workflow's runs, failed with one error kind within that time — a
    receiver that keeps failing — the engine pauses the step for the whole workflow by itself
    (recovery.engine.transitions.workflow_pauses) and raises one alert; a supervisor releases it
    (``unpause_workflow``). Set it below the step's retry budget, or runs reach review first."""

    failures: int
    within: timedelta

    def __post_init__(self) -> None:
        if self.failures < 1 or self.within <= timedelta(0):
            raise ValueError("pause_after: failures is at least 1, within is longer than nothing")

    def text(self, failed: int, kind: str, step: str) -> str:
        """ "5 attempts of post_entry failed (transient) within 0:02:00" """
        return f"{failed} attempts of {step} failed ({kind}) within {self.within}"


@dataclass(frozen=True)
class Guard:
    """A deterministic check between a model's proposal and a write: it passes, or raises
    ``PolicyRefusal(rule, message, values)``. ``steps``: the steps it guards (a workflow's
    guard; None: every step that acts on a decision)."""

    rule: str
    check: Callable[[GuardContext], None]
    description: str = ""
    steps: tuple[str, ...] | None = None


@dataclass(frozen=True)
class AgentContext(StepContext):
    """What an agent step's function sees for one model turn: the step's context, the
    conversation so far as the journal holds it (``messages``: OpenAI-style assistant turns
    with their tool calls, and one tool message per call with its result, error or refusal),
    the tools' definitions (``tools``: OpenAI function-calling format) and the turn's number.
    The function adds its own prompt, asks the model once and returns its reply."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    turn: int = 1


def idempotency_key(workflow_id: str, step: str, key_version: int) -> str:
    """``hash(workflow_id:step:vN)``: the same for every attempt, process and operator click."""
    return hashlib.sha256(f"{workflow_id}:{step}:v{key_version}".encode()).hexdigest()


def compensation_key(workflow_id: str, step: str, key_version: int) -> str:
    """A compensation's own stable key, distinct from the key of the action it undoes."""
    return idempotency_key(workflow_id, f"{step}.compensate", key_version)


def payload_hash(payload: Any) -> str:
    """sha256 of canonical JSON. The engine hashes only redacted data (a step's
    intent): exactly what it persists and what the step is called with, so the hash still
    tells a changed request from a repeat, and no hash of a credential is ever stored."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass
class StepSpec:
    name: str
    call: Callable[[StepContext], Any]
    effect: str
    rerun: Rerun
    key_version: int
    retry: RetryPolicy
    reconcile: Reconcile | None
    position: int
    decision_schema: type[pydantic.BaseModel] | None = None
    schema_version: int = 1
    # schema version k -> a function turning a decision accepted under k into one of k + 1: how a
    # run moved to this version keeps its decision (recovery.engine.transitions.versions)
    decision_migrations: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = field(default_factory=dict)
    keep_invalid_output: bool = True
    intent_fn: Callable[[StepContext], dict[str, Any]] | None = None
    lookup_fn: Callable[[StepContext], Outcome | None] | None = None
    # An operator's evidence "it succeeded, remote id X", checked at the receiver: the object
    # X as the look-up by key would have found it, None when the receiver has no X; raises
    # errors.NotThisStep when X exists but is another request's (recovery.engine.evidence).
    lookup_ref_fn: Callable[[StepContext, str], Outcome | None] | None = None
    # The step's result, declared: what an operator fills in when the receiver cannot be asked.
    result_schema: type[pydantic.BaseModel] | None = None
    compensable: bool = False
    outbox: bool = False
    local: bool = False  # its effect is written to this database, in the transaction of its outcome
    compensation_fn: Callable[[StepContext], Any] | None = None
    compensation: Compensation | None = None
    guards: list[Guard] = field(default_factory=list)  # this step's own (Workflow.guards_for adds the workflow's)
    # The call's own timeout in seconds (a number, or a function of the settings); None: the
    # adapters' RECOVERY_HTTP_TIMEOUT.
    timeout: float | Callable[[], float | None] | None = None
    # The in-flight bound (see in_flight_bound); DEFAULT_SETTLE derives it from the timeout.
    settle: timedelta | None = DEFAULT_SETTLE
    # An agent step's loop (its row) and each of its model turns (their rows: journal names).
    agent: AgentPolicy | None = None
    # Paused by itself when its receiver keeps failing; None: the workflow's (Workflow.pause_policy).
    pause_after: PauseAfter | None = None
    # What a restart across this step makes when its effect is not undone first: a second one
    # beside the first, in the words the console states before confirming ("a second message goes
    # to the approver; the first stands"). Empty: a restart undoes the effect first (its
    # compensation), or is refused where the step has none (recovery.engine.transitions.restarts).
    second_effect: str = ""
    # The pydantic model of the step's intent: a supervisor's corrected intent is validated by it
    # (without one, a correction keeps the intent's fields and their JSON types).
    intent_schema: type[pydantic.BaseModel] | None = None
    # A step that waits for an event or a time, holding no worker (recovery.waiting).
    wait: WaitSpec | None = None

    # decorators, in the style of property setters
    def intent(self, fn: Callable[[StepContext], dict[str, Any]]) -> Callable:
        self.intent_fn = fn
        return fn

    def lookup(self, fn: Callable[[StepContext], Outcome | None]) -> Callable:
        self.lookup_fn = fn
        return fn

    def lookup_ref(self, fn: Callable[[StepContext, str], Outcome | None]) -> Callable:
        """Declare the look-up of this step's remote object by the receiver's own id
        (``fn(ctx, remote_ref)``): how an operator's "it succeeded, remote id X" is checked
        before it is recorded. Return the object's ``Outcome`` exactly as the step's call (or
        its ``@lookup`` by key) would, None when the receiver has no such object, and raise
        ``NotThisStep`` when it has one that another request made (another key, another
        reference, another tenant)."""
        self.lookup_ref_fn = fn
        return fn

    def evidence_rule(self) -> str:
        """How an operator's "it succeeded" is checked for this step ("" when it cannot be)."""
        if self.lookup_ref_fn is not None:
            return "the remote id is looked up at the receiver and must be this step's"
        if self.result_schema is not None:
            return f"the operator fills the result ({self.result_schema.__name__}), validated"
        return ""

    def guard(self, rule: str, *, description: str = "") -> Callable[[Callable], Callable]:
        """Declare a check that runs before each attempt's intent is checkpointed (after the
        decision is accepted, before anything is sent): it returns, or raises
        ``PolicyRefusal``, which writes nothing and sends the run to review."""
        if self.asks_model:
            what = "its tools" if self.agent is not None else "the steps that act on its decision"
            raise ValueError(f"{self.name} is a model step: guard {what}")

        def register(fn: Callable) -> Callable:
            self.guards.append(Guard(rule, fn, description or _first_line(fn)))
            return fn

        return register

    def compensate(
        self, fn: Callable | None = None, *, description: str = "", who: str = "supervisor", restores: bool = False
    ) -> Callable:
        """Declare the business operation that undoes this step's effect. It gets the step's
        result in ``ctx.intent`` (``remote_ref``, ``result``, ``intent``) and its own stable
        ``ctx.idempotency_key``; it must be idempotent under that key, because after a crash
        it is simply run again."""

        if who not in ("operator", "supervisor"):
            raise ValueError(f"{self.name}: who={who!r}: a compensation is triggered by an operator or a supervisor")

        def register(f: Callable) -> Callable:
            self.compensation_fn = f
            self.compensation = Compensation(description=description or _first_line(f), who=who, restores=restores)
            return f

        return register(fn) if fn is not None else register

    @property
    def is_wait(self) -> bool:
        return self.wait is not None

    @property
    def is_decision(self) -> bool:
        return self.decision_schema is not None

    @property
    def is_agent(self) -> bool:
        """The agent step itself: a loop of model turns and tool calls the executor drives."""
        return self.agent is not None and not is_journal_name(self.name)

    @property
    def is_turn(self) -> bool:
        """One model turn of an agent step (a journal row)."""
        return self.agent is not None and is_journal_name(self.name)

    @property
    def asks_model(self) -> bool:
        return self.is_decision or self.agent is not None

    @property
    def writes(self) -> bool:
        """Whether the step has an effect a repeat could double (or a local write)."""
        return self.outbox or self.local or self.rerun != Rerun.YES

    @property
    def reads(self) -> bool:
        """A plain read: no effect anywhere and no model asked, so it may simply be made again
        (a check built from a decision that an operator then replaced, say)."""
        return not self.writes and not self.asks_model

    def call_timeout(self) -> float:
        """Seconds the step's call waits for an answer before its outcome is unknown."""
        timeout = self.timeout() if callable(self.timeout) else self.timeout
        return float(settings.RECOVERY_HTTP_TIMEOUT if timeout is None else timeout)

    def in_flight_bound(self) -> timedelta | None:
        """How long after a request was sent the receiver may still commit it (rule 7). A
        look-up that finds nothing proves absence only once this much time has passed since the
        request was sent; before that the outcome stays unknown. ``None``: unbounded, a miss
        goes to an operator. Undeclared: the call's timeout plus RECOVERY_SETTLE_SECONDS (a
        receiver may go on working well after its caller gave up)."""
        if self.settle is DEFAULT_SETTLE:
            return timedelta(seconds=self.call_timeout() + settings.RECOVERY_SETTLE_SECONDS)
        return self.settle

    def in_flight_until(self, sent_at: datetime | None) -> datetime | None:
        """When a request sent at ``sent_at`` can no longer commit; None if never (unbounded)."""
        bound = self.in_flight_bound()
        if bound is None:
            return None
        return (sent_at or datetime.min.replace(tzinfo=UTC)) + bound

    def in_flight_text(self) -> str:
        """The in-flight bound as the contract table shows it."""
        if self.is_decision or self.local or self.rerun == Rerun.YES:
            return ""
        bound = self.in_flight_bound()
        if bound is None:
            return "unbounded: a miss goes to an operator"
        default = " (default: timeout + RECOVERY_SETTLE_SECONDS)" if self.settle is DEFAULT_SETTLE else ""
        return f"{bound.total_seconds():g} s{default}"

    def recovery_rule(self) -> str:
        if self.is_agent:
            return "journal: a recorded turn is never asked again, a recorded tool call never made again"
        if self.is_decision:
            return "reuse the accepted decision; ask the model again only while none is accepted"
        if self.outbox:
            return "transactional outbox: the publisher looks the message up by key before any resend"
        if self.local:
            return "local transaction: the effect commits with the outcome; an interrupted attempt left nothing"
        return Reconcile(self.reconcile).label if self.reconcile else "none declared"

    def contract_row(self) -> dict[str, Any]:
        return {
            "step": self.name,
            "side_effect": self.effect,
            "safe_to_rerun": str(self.rerun),
            "recovery_rule": self.recovery_rule(),
            "retry_policy": self.retry.as_text(),
            "key_version": self.key_version,
            "decision_schema": f"{self.decision_schema.__name__} v{self.schema_version}"
            if self.decision_schema
            else "",
            "in_flight_bound": self.in_flight_text(),
            "compensation": self.compensation.description if self.compensation else "",
            "compensation_by": self.compensation.who if self.compensation else "",
        }


@dataclass
class ToolSpec(StepSpec):
    """A tool an agent's model may call: a step's recovery contract, plus its arguments'
    schema (the model's tool definition). Under a journal row's name (``Workflow.get_step``)
    it is the contract of one call."""

    arguments: type[pydantic.BaseModel] | None = None
    description: str = ""
    tool_name: str = ""
    # Its calls (or those the rule picks) wait for a person before anything is sent (recovery.waiting).
    approval: ToolApproval | None = None

    def definition(self) -> dict[str, Any]:
        """The tool as OpenAI-compatible function calling declares it."""
        parameters = self.arguments.model_json_schema() if self.arguments else {"type": "object", "properties": {}}
        return {
            "type": "function",
            "function": {"name": self.tool_name, "description": self.description, "parameters": parameters},
        }


@dataclass(frozen=True)
class AgentPolicy:
    """An agent step's loop: its tools, its final answer's schema and its budgets."""

    tools: dict[str, ToolSpec]
    schema: type[pydantic.BaseModel]
    schema_version: int
    max_turns: int
    argument_errors: int
    refusals: str  # "model": a guard's refusal is answered to the model; "review": it holds the call

    def definitions(self) -> list[dict[str, Any]]:
        return [tool.definition() for tool in self.tools.values()]


# An agent's journal rows are named agent:turn (a model turn) and agent:turn:index:tool (a tool
# call); a step's own name never holds the separator. A call's key is then exactly
# hash(workflow_id:agent:turn:index:tool:vN).
JOURNAL_SEPARATOR = ":"
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,40}")
MAX_AGENT_NAME = 40  # a journal row's name (agent:turn:index:tool) fits the 100 characters of a step's


@dataclass(frozen=True)
class JournalName:
    agent: str
    turn: int
    index: int | None = None
    tool: str | None = None


def is_journal_name(name: str) -> bool:
    """Whether ``name`` names one of an agent's journal rows (a turn or a tool call), not a step."""
    return JOURNAL_SEPARATOR in name


def metric_label(name: str) -> str:
    """A step's name as a metric labels it: a journal row by its tool (``credit``, not
    ``resolve:2:0:credit``: bounded cardinality), any other row by its own name."""
    return (parse_journal_name(name).tool or name) if is_journal_name(name) else name


def journal_rows(agent: str, rows: Iterable[Any]) -> list[Any]:
    """The rows (anything with a ``step_name``) of ``agent``'s journal, in the order given."""
    prefix = agent + JOURNAL_SEPARATOR
    return [row for row in rows if row.step_name.startswith(prefix)]


def turn_name(agent: str, turn: int) -> str:
    return f"{agent}{JOURNAL_SEPARATOR}{turn}"


def call_name(agent: str, turn: int, index: int, tool: str) -> str:
    return JOURNAL_SEPARATOR.join((agent, str(turn), str(index), tool))


def parse_journal_name(name: str) -> JournalName:
    parts = name.split(JOURNAL_SEPARATOR)
    try:
        if len(parts) == 2:
            return JournalName(parts[0], int(parts[1]))
        if len(parts) == 4:
            return JournalName(parts[0], int(parts[1]), int(parts[2]), parts[3])
    except ValueError:
        pass
    raise LookupError(f"{name!r} is not an agent journal row (agent:turn or agent:turn:index:tool)")


def _arguments(ctx: StepContext) -> dict[str, Any]:
    """A tool call's intent: its validated arguments, written with the call's row."""
    return dict(ctx.intent or {})


def _turn_summary(ctx: StepContext) -> dict[str, Any]:
    """A model turn's intent: what it asks with, in short (the conversation is the journal)."""
    messages = getattr(ctx, "messages", [])
    return {
        "turn": getattr(ctx, "turn", 0),
        "messages": len(messages),
        "tool_results": sum(1 for m in messages if m.get("role") == "tool"),
        "conversation": payload_hash(messages),
    }


def _first_line(fn: Callable) -> str:
    return (fn.__doc__ or fn.__name__).strip().splitlines()[0]
