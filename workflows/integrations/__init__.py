"""What the workflows share: the systems they talk to and how they retry.

- ``adapters`` — the HTTP adapters to the simulated task tracker, messenger and ledger (the
  sandbox's receivers), with the shared HTTP client and its classification of failures;
- ``openai`` — the OpenAI-compatible chat-completions client (built from ``OPENAI_*`` settings)
  and the model call's timeout;
- ``policies`` — the retry policies for reads, model calls, writes and the ledger.

The rule: a workflow imports this package and ``recovery.workflow`` (the authors' API), never
another workflow's modules; what two workflows need comes here. ``pyproject.toml``'s
import-linter contracts enforce it.
"""
