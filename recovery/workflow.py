"""Declaring a workflow: ordered steps, each with its recovery contract.

    orders = Workflow("orders", version=1, workflow_id=lambda i: f"order:{i['tenant']}:{i['order_id']}")

    @orders.step(effect="creates a task in the tracker", rerun=Rerun.NO, key_version=1,
                 reconcile=Reconcile.LOOKUP, retry=RetryPolicy(maximum_attempts=5))
    def create_task(ctx):
        return tracker.create(ctx.intent, idempotency_key=ctx.idempotency_key)

    @create_task.intent
    def _(ctx):
        return {"title": f"Approve {ctx.input['order_id']}"}

    @create_task.lookup
    def _(ctx):
        return tracker.find_by_key(ctx.idempotency_key)   # an Outcome, or None if it never happened

    @create_task.guard("assignee_policy")
    def _(ctx):                                   # before the intent is checkpointed: nothing sent yet
        if ctx.intent["assignee"] != policy.approver_for(ctx.decision):
            raise PolicyRefusal("assignee_policy", "not the approver the policy assigns",
                                {"proposed": ctx.intent["assignee"]})

The engine reads this declaration; the recovery contract table is derived from it, and
``manage.py check`` refuses a workflow whose unsafe step has no unknown-outcome path (and
warns about a step that acts on a model's decision with no guard).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pydantic
from django.conf import settings
from django.db import models

from recovery import redaction
from recovery.actions import FOUR_EYES_ACTIONS
from recovery.errors import PolicyRefusal as PolicyRefusal  # re-exported: a guard raises it
from recovery.registry import (  # noqa: F401  (re-exported: the registry, as authors and the engine knew it)
    VersionNotDeployed,
    all_versions,
    all_workflows,
    get_workflow,
    register,
    workflow_of,
)
from recovery.retries import DEFAULT_POLICY, RetryPolicy


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

    def result(self, step: str) -> Any:
        return self.results[step]


@dataclass(frozen=True)
class GuardContext(StepContext):
    """What a guard sees: the step's context with the intent about to be checkpointed, and
    ``decision``, the accepted decision of the latest model step before it. A guard reads the
    current state of other systems itself (through the workflow's adapters), fresh each time."""

    decision: dict[str, Any] | None = None


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
    """sha256 of canonical JSON. The engine hashes only redacted data (a run's input, a step's
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

    # decorators, in the style of property setters
    def intent(self, fn: Callable[[StepContext], dict[str, Any]]) -> Callable:
        self.intent_fn = fn
        return fn

    def lookup(self, fn: Callable[[StepContext], Outcome | None]) -> Callable:
        self.lookup_fn = fn
        return fn

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


def _stuck_after(value: timedelta | Mapping[str, timedelta] | None) -> dict[str, timedelta]:
    from recovery.counts import STUCK_LABELS  # reads the models: only once the app registry is ready

    if value is None:
        return {}
    chosen = {"any": value} if isinstance(value, timedelta) else dict(value)
    unknown = sorted(set(chosen) - {*STUCK_LABELS, "any"})
    if unknown:
        raise ValueError(f"stuck_after: no stuck cause {', '.join(unknown)} (one of {', '.join(STUCK_LABELS)}, any)")
    for cause, after in chosen.items():
        if not isinstance(after, timedelta) or after <= timedelta(0):
            raise ValueError(f"stuck_after[{cause!r}] must be a positive timedelta, got {after!r}")
    return chosen


class Workflow:
    def __init__(
        self,
        name: str,
        *,
        version: int,
        workflow_id: Callable[[dict[str, Any]], str],
        input_schema: type[pydantic.BaseModel] | None = None,
        description: str = "",
        compensation: CompensationPolicy = CompensationPolicy.OPERATOR,
        redact_fields: tuple[str, ...] = (),
        four_eyes: bool | Iterable[str] = False,
        stuck_after: timedelta | Mapping[str, timedelta] | None = None,
    ):
        """``redact_fields`` names this workflow's own sensitive keys, redacted wherever the
        engine persists its data, on top of ``RECOVERY_REDACT_FIELDS`` (recovery.redaction).

        ``four_eyes``: the operator actions that need a second supervisor's approval before
        they run (``FOUR_EYES_ACTIONS``: ``compensate``, ``terminate``, ``resolve_happened`` —
        "mark succeeded"); ``True`` for all of them. One person requests, another approves
        (recovery.engine.transitions.approval_request / approval_grant).

        ``stuck_after``: when a run of this workflow that is stuck (a person must act, or
        something is wrong: the console's stuck causes) raises an alert — one duration for
        every cause, or one per cause (``{"unknown": timedelta(minutes=5), "any": …}``; "any"
        for the causes not named). Counted from the run's last change. None: no alert."""
        self.name = name
        self.version = version
        self._workflow_id = workflow_id
        self.input_schema = input_schema
        self.description = description
        self.compensation = CompensationPolicy(compensation)
        self.redact_fields = tuple(redact_fields)
        chosen = FOUR_EYES_ACTIONS if four_eyes is True else frozenset(four_eyes or ())
        if not chosen <= FOUR_EYES_ACTIONS:
            unknown, known = (", ".join(sorted(names)) for names in (chosen - FOUR_EYES_ACTIONS, FOUR_EYES_ACTIONS))
            raise ValueError(f"four_eyes: {unknown} cannot need approval (one of {known})")
        self.four_eyes: frozenset[str] = frozenset(chosen)
        self.stuck_after: dict[str, timedelta] = _stuck_after(stuck_after)
        self.steps: list[StepSpec] = []
        self.tools: dict[str, ToolSpec] = {}
        self.guards: list[Guard] = []
        register(self)

    def guard(
        self, rule: str, *, steps: Iterable[str] | None = None, description: str = ""
    ) -> Callable[[Callable], Callable]:
        """Declare a check for several steps: ``steps`` names them; by default every step that
        acts on a model's decision (a step with an effect after a decision step). It runs
        before each of them, as a step's own guards do (``StepSpec.guard``)."""

        def register(fn: Callable) -> Callable:
            chosen = tuple(steps) if steps is not None else None
            self.guards.append(Guard(rule, fn, description or _first_line(fn), chosen))
            return fn

        return register

    def derive(self, *, version: int, without: Iterable[str] = ()) -> Workflow:
        """Another version of this workflow, registered beside it: the same settings, guards and
        tools, and the same steps but ``without`` those named — how a module keeps its previous
        definition until its runs have drained when the new version added steps
        (``invoice_v1 = invoice.derive(version=1, without=["check_duplicate"])``). Runs started
        on it execute these steps, in this order, to the end. A step whose business action
        changed needs a new key version in the new definition, not a shared one."""
        dropped = set(without)
        unknown = sorted(dropped - {s.name for s in self.steps})
        if unknown:
            raise ValueError(f"{self.name} v{self.version} has no step {', '.join(unknown)} to leave out")
        other = Workflow(
            self.name,
            version=version,
            workflow_id=self._workflow_id,
            input_schema=self.input_schema,
            description=self.description,
            compensation=self.compensation,
            redact_fields=self.redact_fields,
            four_eyes=self.four_eyes,
            stuck_after=self.stuck_after or None,
        )
        kept = [s for s in self.steps if s.name not in dropped]
        other.steps = [replace(s, position=i, guards=list(s.guards)) for i, s in enumerate(kept)]
        other.tools = dict(self.tools)
        other.guards = list(self.guards)
        return other

    def overdue_after(self, cause: str) -> timedelta | None:
        """How long a run may be stuck for ``cause`` before it raises an alert (None: never)."""
        return self.stuck_after.get(cause, self.stuck_after.get("any"))

    def writes(self, step_name: str) -> bool:
        """Whether the step (or agent's tool call) of that name has an effect that, once made,
        stands elsewhere (not a model's decision, not a model turn)."""
        try:
            spec = self.get_step(step_name)
        except LookupError:
            return False
        return spec.writes and not spec.asks_model

    def acts_on_decision(self, spec: StepSpec) -> bool:
        """Whether ``spec`` writes after a model step: what it sends may come from the model."""
        if isinstance(spec, ToolSpec):
            return spec.writes  # the model chose the call and its arguments
        return spec.writes and not spec.asks_model and any(s.is_decision for s in self.steps[: spec.position])

    def guards_for(self, spec: StepSpec) -> list[Guard]:
        """The checks that run before ``spec``'s intent is checkpointed, in order: the
        workflow's that apply to it, then the step's own."""
        name = spec.tool_name if isinstance(spec, ToolSpec) else spec.name
        shared = [g for g in self.guards if (name in g.steps if g.steps is not None else self.acts_on_decision(spec))]
        return shared + list(spec.guards)

    def decision_before(self, spec: StepSpec) -> StepSpec | None:
        """The latest model step before ``spec`` (whose decision a guard sees)."""
        return next((s for s in reversed(self.steps[: spec.position]) if s.is_decision), None)

    def step(
        self,
        *,
        effect: str = "none",
        rerun: Rerun = Rerun.YES,
        key_version: int = 1,
        retry: RetryPolicy = DEFAULT_POLICY,
        reconcile: Reconcile | None = None,
        compensable: bool = False,
        outbox: bool = False,
        local: bool = False,
        name: str | None = None,
        timeout: float | Callable[[], float | None] | None = None,
        settle: timedelta | None = DEFAULT_SETTLE,
    ) -> Callable[[Callable], StepSpec]:
        """Declare the next step. A step safe to re-run reconciles by re-running by default.

        ``timeout`` is the call's own timeout in seconds (default: RECOVERY_HTTP_TIMEOUT);
        ``settle`` its in-flight bound, how long after a request was sent the receiver may
        still commit it (default: the timeout plus RECOVERY_SETTLE_SECONDS; ``None``:
        unbounded, an unknown outcome that a look-up does not find goes to an operator). The
        engine never concludes from a look-up that finds nothing that a call did not happen
        before that bound has passed, and the same bound covers the step's compensation.

        With ``outbox=True`` the executor does not call the step: it writes its intent as an
        outbox row in the same transaction as the step's success, and the outbox publisher
        calls the step function later, with retries, looking the message up (``@lookup``)
        before any repeat, so it is delivered once even across crashes.

        With ``local=True`` the step's effect is a write to the engine's own database: the
        executor calls it inside the transaction that records its outcome, so the effect and
        the outcome commit together or not at all, and an attempt cut short is simply run
        again (exactly once, with no key or look-up needed)."""
        if local:
            if outbox or reconcile not in (None, Reconcile.RERUN):
                raise ValueError("a local step commits with its outcome: no outbox, and it reconciles by re-running")
            reconcile = Reconcile.RERUN
        if reconcile is None and rerun == Rerun.YES:
            reconcile = Reconcile.RERUN

        def decorate(fn: Callable) -> StepSpec:
            spec = StepSpec(
                name=name or fn.__name__,
                call=fn,
                effect=effect,
                rerun=Rerun(rerun),
                key_version=key_version,
                retry=retry,
                reconcile=Reconcile(reconcile) if reconcile else None,
                position=len(self.steps),
                compensable=compensable,
                outbox=outbox,
                local=local,
                timeout=timeout,
                settle=settle,
            )
            if any(s.name == spec.name for s in self.steps):
                raise ValueError(f"workflow {self.name!r} already has a step named {spec.name!r}")
            if is_journal_name(spec.name):
                raise ValueError(f"step name {spec.name!r}: {JOURNAL_SEPARATOR!r} marks an agent's journal rows")
            self.steps.append(spec)
            return spec

        return decorate

    def decision(
        self,
        *,
        schema: type[pydantic.BaseModel],
        schema_version: int = 1,
        effect: str = "provider usage, generated output",
        retry: RetryPolicy = DEFAULT_POLICY,
        keep_invalid_output: bool = True,
        name: str | None = None,
        timeout: float | Callable[[], float | None] | None = None,
        migrate: Mapping[int, Callable[[dict[str, Any]], dict[str, Any]]] | None = None,
    ) -> Callable[[Callable], StepSpec]:
        """Declare a model step. It returns a *proposal* (JSON text or a dict); the engine
        validates it against ``schema``, stores the accepted decision before any later
        step can use it, and reuses it on every re-run. ``timeout``: the model call's own (a
        number of seconds or a function of the settings), checked against the lease.

        ``migrate``: ``{k: fn}`` turns a decision accepted under schema version k into one of
        version k + 1 (a dict in, a dict out), so that a run moved to this workflow version from
        an older one keeps its accepted decision, migrated and validated against ``schema``
        (a new decision version, audited); without it such a move is refused."""
        steps = dict(migrate or {})
        if any(not 1 <= k < schema_version for k in steps):
            raise ValueError(f"migrate: schema versions from 1 to {schema_version - 1}, each to the next")

        def decorate(fn: Callable) -> StepSpec:
            spec = self.step(
                effect=effect, rerun=Rerun.USUALLY, reconcile=Reconcile.RERUN, retry=retry, name=name, timeout=timeout
            )(fn)
            spec.decision_schema = schema
            spec.schema_version = schema_version
            spec.decision_migrations = steps
            spec.keep_invalid_output = keep_invalid_output
            return spec

        return decorate

    def redact(self, value: Any) -> Any:
        """``value`` as the engine may persist it: credentials replaced (recovery.redaction)."""
        return redaction.redact(value, fields=self.redact_fields)

    def workflow_id(self, data: dict[str, Any]) -> str:
        return self._workflow_id(data)

    def validate_input(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise ValueError("workflow input must be a JSON object")
        if self.input_schema is None:
            return data
        return self.input_schema.model_validate(data).model_dump(mode="json")

    def get_step(self, name: str) -> StepSpec:
        for spec in self.steps:
            if spec.name == name:
                return spec
        if is_journal_name(name):
            return self._journal_spec(name)
        raise LookupError(f"workflow {self.name!r} has no step {name!r}")

    def compensates(self, step_name: str) -> bool:
        """Whether the step (or an agent's tool call) of that name declares a compensation."""
        try:
            return self.get_step(step_name).compensation_fn is not None
        except LookupError:
            return False

    def agent_of(self, spec: StepSpec) -> StepSpec | None:
        """The agent step whose journal row ``spec`` is (a turn or a tool call); None for a step."""
        if not is_journal_name(spec.name):
            return None
        return self.get_step(parse_journal_name(spec.name).agent)

    def _journal_spec(self, name: str) -> StepSpec:
        """The contract of an agent's journal row: a turn is its agent's model call under the
        row's name; a tool call is the tool's declaration under the row's name."""
        entry = parse_journal_name(name)
        agent = self.get_step(entry.agent)
        if entry.agent == name or agent.agent is None:
            raise LookupError(f"workflow {self.name!r} has no agent step {entry.agent!r} (row {name!r})")
        if entry.tool is None:
            spec = replace(agent, name=name)
        else:
            tool = agent.agent.tools.get(entry.tool)
            if tool is None:
                raise LookupError(f"agent {entry.agent!r} has no tool {entry.tool!r} (row {name!r})")
            spec = replace(tool, name=name, position=agent.position)
        return spec

    def tool(
        self,
        *,
        arguments: type[pydantic.BaseModel],
        effect: str = "none",
        rerun: Rerun = Rerun.YES,
        key_version: int = 1,
        retry: RetryPolicy = DEFAULT_POLICY,
        reconcile: Reconcile | None = None,
        compensable: bool = False,
        local: bool = False,
        name: str | None = None,
        description: str = "",
        timeout: float | Callable[[], float | None] | None = None,
        settle: timedelta | None = DEFAULT_SETTLE,
    ) -> Callable[[Callable], ToolSpec]:
        """Declare a tool an agent step's model may call, with the same recovery contract as a
        step (``effect``, ``rerun``, ``reconcile`` with ``@tool.lookup``, ``@tool.compensate``,
        ``@tool.guard``, ``retry``, ``timeout``, ``settle``: see ``step``). ``arguments`` is the
        pydantic model of its arguments: its JSON schema is the tool's definition for the model,
        and every call's arguments are validated against it before anything is written; the
        validated arguments are the call's intent (``ctx.intent``). ``description`` (default: the
        function's first docstring line) tells the model what the tool does.

        Each call is a row of the run, named ``agent:turn:index:tool``, whose idempotency key is
        ``hash(workflow_id:agent:turn:index:tool:vN)``: stable across crashes and resumes."""
        if local and reconcile not in (None, Reconcile.RERUN):
            raise ValueError("a local tool commits with its outcome: it reconciles by re-running")
        if reconcile is None and (local or rerun == Rerun.YES):
            reconcile = Reconcile.RERUN

        def decorate(fn: Callable) -> ToolSpec:
            tool_name = name or fn.__name__
            if not _TOOL_NAME.fullmatch(tool_name):
                raise ValueError(f"tool name {tool_name!r}: letters, digits, _ and - only (at most 40)")
            if tool_name in self.tools:
                raise ValueError(f"workflow {self.name!r} already has a tool named {tool_name!r}")
            spec = ToolSpec(
                name=tool_name,
                call=fn,
                effect=effect,
                rerun=Rerun(rerun),
                key_version=key_version,
                retry=retry,
                reconcile=Reconcile(reconcile) if reconcile else None,
                position=-1,
                compensable=compensable,
                local=local,
                timeout=timeout,
                settle=settle,
                intent_fn=_arguments,
                arguments=arguments,
                description=description or _first_line(fn),
                tool_name=tool_name,
            )
            self.tools[tool_name] = spec
            return spec

        return decorate

    def agent(
        self,
        *,
        tools: Iterable[ToolSpec],
        schema: type[pydantic.BaseModel],
        schema_version: int = 1,
        max_turns: int = 8,
        argument_errors: int = 2,
        refusals: str = "model",
        retry: RetryPolicy = DEFAULT_POLICY,
        effect: str = "provider usage; its tools' effects",
        name: str | None = None,
        timeout: float | Callable[[], float | None] | None = None,
    ) -> Callable[[Callable], StepSpec]:
        """Declare an agent step: a loop the engine drives, in which the model calls ``tools``
        until it gives a final answer valid against ``schema`` (the step's result). The
        decorated function makes one model turn: it gets an ``AgentContext`` (the conversation
        the journal holds, the tools' definitions) and returns the model's reply — an
        OpenAI-style assistant message (``content``, ``tool_calls``), or the final answer's
        JSON text.

        Every turn is checkpointed (journaled) before any tool it asked for runs, and every
        tool call is a row with its own key, intent, attempts and outcome: a recorded turn is
        never asked again and a recorded call never made again. ``max_turns``: turns before the
        run goes to review. ``argument_errors``: calls with invalid arguments (or to no such
        tool) answered to the model as a tool error before the run goes to review.
        ``refusals``: what a guard's refusal of a tool call does — ``"model"`` answers it to
        the model (nothing was sent); ``"review"`` holds the call for an operator, as a step's
        refusal does."""
        if refusals not in ("model", "review"):
            raise ValueError(f"refusals={refusals!r}: 'model' or 'review'")
        if max_turns < 1 or argument_errors < 0:
            raise ValueError("max_turns must be at least 1 and argument_errors at least 0")
        chosen = {}
        for tool in tools:
            if self.tools.get(getattr(tool, "tool_name", "")) is not tool:
                raise ValueError(f"{tool!r} is not a tool of workflow {self.name!r} (declare it with @workflow.tool)")
            chosen[tool.tool_name] = tool
        if not chosen:
            raise ValueError("an agent step needs at least one tool")

        def decorate(fn: Callable) -> StepSpec:
            if len(name or fn.__name__) > MAX_AGENT_NAME:
                raise ValueError(
                    f"an agent step's name is at most {MAX_AGENT_NAME} characters (its journal rows add to it)"
                )
            spec = self.step(
                effect=effect, rerun=Rerun.USUALLY, reconcile=Reconcile.RERUN, retry=retry, name=name, timeout=timeout
            )(fn)
            spec.agent = AgentPolicy(
                tools=chosen,
                schema=schema,
                schema_version=schema_version,
                max_turns=max_turns,
                argument_errors=argument_errors,
                refusals=refusals,
            )
            spec.schema_version = schema_version
            spec.intent_fn = _turn_summary
            return spec

        return decorate

    def contract(self) -> list[dict[str, Any]]:
        """One row per step, each agent step followed by one row per tool it may call."""
        rows = []
        for spec in self.steps:
            rows.append({**spec.contract_row(), "guards": ", ".join(g.rule for g in self.guards_for(spec))})
            for tool in spec.agent.tools.values() if spec.is_agent else ():
                guards = ", ".join(g.rule for g in self.guards_for(tool))
                rows.append({**tool.contract_row(), "step": f"{spec.name} → tool {tool.name}", "guards": guards})
        return rows

    def __repr__(self) -> str:
        return f"<Workflow {self.name} v{self.version}>"
