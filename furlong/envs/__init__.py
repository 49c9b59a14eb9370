"""Agentic environments: multi-turn tool use, TITO sessions for black-box agents, sandboxes.

- `multiturn.generate`: the `rollout.generate_fn` for tool use and environment feedback.
- `session_server.SessionServer`: OpenAI-compatible sessions that record exact Samples
  (`furlong envs sessions --engine URL --port P`); `session_store`: their exact-token bookkeeping.
- `protocol`: the async Environment protocol (reset / step / reward) and `build_environment`;
  built-ins `calculator.CalculatorEnvironment`, `coding.CodingEnvironment`.
- `sandbox/`: untrusted code in a limited, isolated process (`sandbox.local.LocalSandbox`, `furlong envs
  sandbox FILE`) or a remote one (`sandbox.e2b`, `sandbox.daytona`); `sandbox.factory.build_sandbox`.
- `tools`: async tool execution with timeouts (parsing is `furlong.core.tool_calls`, suffix tokenisation
  `furlong.data.chat`).

Imports stay lazy (nothing here is imported by this package's `__init__`), so `furlong`
commands that do not use environments do not pay for them.
"""
