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

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pydantic

from recovery import redaction
from recovery.actions import FOUR_EYES_ACTIONS
from recovery.contract import (  # noqa: F401  (re-exported: the authors' API)
    _TOOL_NAME,
    DEFAULT_SETTLE,
    JOURNAL_SEPARATOR,
    MAX_AGENT_NAME,
    AgentContext,
    AgentPolicy,
    Compensation,
    CompensationPolicy,
    Guard,
    GuardContext,
    JournalName,
    Outcome,
    PauseAfter,
    Reconcile,
    Rerun,
    StepContext,
    StepSpec,
    ToolSpec,
    _arguments,
    _first_line,
    _turn_summary,
    call_name,
    compensation_key,
    idempotency_key,
    is_journal_name,
    journal_rows,
    metric_label,
    parse_journal_name,
    payload_hash,
    turn_name,
)
from recovery.errors import NotThisStep as NotThisStep  # re-exported: a @lookup_ref raises it
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
from recovery.states import STUCK_LABELS
from recovery.waiting import OnTimeout, ToolApproval, WaitSpec


def _stuck_after(value: timedelta | Mapping[str, timedelta] | None) -> dict[str, timedelta]:
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
        pause_after: PauseAfter | None = None,
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
        for the causes not named). Counted from the run's last change. None: no alert.

        ``pause_after``: each step that makes an attempt (not a local step) pauses itself for the
        whole workflow when its receiver keeps failing (``PauseAfter``); a step's own overrides it."""
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
        self.pause_after = pause_after
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
        result: type[pydantic.BaseModel] | None = None,
        pause_after: PauseAfter | None = None,
        second_effect: str = "",
        intent_schema: type[pydantic.BaseModel] | None = None,
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
        again (exactly once, with no key or look-up needed).

        ``result``: the pydantic model of the step's result. Where the receiver cannot be asked
        by its own id (no ``@lookup_ref``), an operator's "it succeeded" fills it in, validated.

        ``pause_after``: pause this step for the whole workflow when its receiver keeps failing
        (``PauseAfter``; default: the workflow's).

        ``second_effect``: a supervisor's restart of the run from an earlier step (with a corrected
        input) may let this step's effect stand and make a second one under a new key; the words
        say what happens ("a second message goes to the approver; the first stands") and the
        console states them before confirming. Without it, a restart undoes the effect first (the
        step's compensation) or is refused. ``intent_schema``: the pydantic model a corrected intent
        of this step is validated by.
        """
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
                result_schema=result,
                pause_after=pause_after,
                second_effect=second_effect,
                intent_schema=intent_schema,
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

    def wait(
        self,
        *,
        event: str,
        timeout: timedelta,
        on_timeout: OnTimeout,
        schema: type[pydantic.BaseModel] | None = None,
        name: str | None = None,
        when: Callable[[StepContext], bool] | None = None,
    ) -> Callable[[Callable], StepSpec]:
        """Declare a step that waits for the event ``event`` (recovery.waiting): the run holds no
        worker while it waits. The function turns the event's payload (``ctx.event``, validated
        by ``schema`` when it was delivered) into the step's result; returning None keeps the
        payload. ``timeout`` counts from the moment the wait is reached; ``on_timeout`` says what
        then (``OnTimeout.proceed(default)``, ``OnTimeout.review()``, or ``OnTimeout.escalate(role,
        timeout=…)``: it waits on for a person of that role, then goes to review). ``when(ctx)``:
        whether this run waits at all — when it says no, the step goes on at once (the function's
        result, with ``ctx.event`` None), said so in the audit trail."""
        spec = WaitSpec(event=event, timeout=timeout, on_timeout=on_timeout, schema=schema, when=when)
        return self._waiting(spec, name)

    def sleep(
        self, *, until: Callable[[StepContext], datetime] | None = None, duration: timedelta | None = None, name=None
    ) -> Callable[[Callable], StepSpec]:
        """Declare a durable timer: the run sleeps, holding no worker, ``duration`` from the moment
        it is reached or ``until(ctx)`` (an aware datetime); then the function's result is the
        step's (None: the time it woke)."""
        spec = WaitSpec(event="", timeout=duration, until=until, on_timeout=OnTimeout.proceed(None))
        return self._waiting(spec, name)

    def _waiting(self, wait: WaitSpec, name: str | None) -> Callable[[Callable], StepSpec]:
        def decorate(fn: Callable) -> StepSpec:
            spec = self.step(name=name, retry=RetryPolicy(maximum_attempts=1))(fn)
            spec.wait = wait
            spec.effect = wait.describe()
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

    def pause_policy(self, spec: StepSpec) -> PauseAfter | None:
        """When ``spec`` pauses itself for the whole workflow: its own policy, else the workflow's
        for a step that makes an attempt (a local step makes none to stop before)."""
        if spec.pause_after is not None:
            return spec.pause_after
        return None if spec.local else self.pause_after

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
        result: type[pydantic.BaseModel] | None = None,
        needs_approval: bool | Callable[[dict[str, Any], StepContext], bool] = False,
        approver: str = "supervisor",
        approval_timeout: timedelta = timedelta(days=3),
        on_approval_timeout: OnTimeout = OnTimeout.review(),
    ) -> Callable[[Callable], ToolSpec]:
        """Declare a tool an agent step's model may call, with the same recovery contract as a
        step (``effect``, ``rerun``, ``reconcile`` with ``@tool.lookup``, ``@tool.compensate``,
        ``@tool.guard``, ``@tool.lookup_ref``, ``retry``, ``timeout``, ``settle``, ``result``: see
        ``step``). ``arguments`` is the
        pydantic model of its arguments: its JSON schema is the tool's definition for the model,
        and every call's arguments are validated against it before anything is written; the
        validated arguments are the call's intent (``ctx.intent``). ``description`` (default: the
        function's first docstring line) tells the model what the tool does.

        Each call is a row of the run, named ``agent:turn:index:tool``, whose idempotency key is
        ``hash(workflow_id:agent:turn:index:tool:vN)``: stable across crashes and resumes.

        ``needs_approval`` (True, or ``rule(arguments, ctx)``): such a call, once its guards pass,
        waits for a person of role ``approver`` — nothing is sent — who approves, edits, rejects
        or answers it (recovery.waiting.ToolApproval); ``on_approval_timeout`` after
        ``approval_timeout``: review, or ``OnTimeout.escalate(role, timeout=…)``."""
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
                result_schema=result,
                intent_fn=_arguments,
                arguments=arguments,
                description=description or _first_line(fn),
                tool_name=tool_name,
                approval=ToolApproval(needs_approval, approver, approval_timeout, on_approval_timeout)
                if needs_approval
                else None,
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
