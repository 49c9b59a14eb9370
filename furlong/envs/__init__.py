"""Agentic environments: multi-turn tool use, TITO sessions for black-box agents, sandboxes.

- `multiturn.generate`: the `rollout.generate_fn` for tool use and environment feedback.
- `sessions.SessionServer`: OpenAI-compatible sessions that record exact Samples
  (`furlong envs sessions --engine URL --port P`).
- `protocol`: the async Environment protocol (reset / step / reward) and `build_environment`;
  built-ins `calculator.CalculatorEnvironment`, `coding.CodingEnvironment`.
- `sandbox.LocalSandbox`: untrusted code in a limited, isolated process (`furlong envs sandbox FILE`).
- `tools`: `<tool_call>` parsing and async execution with timeouts; `chat`: suffix tokenisation.

Imports stay lazy (nothing here is imported by this package's `__init__`), so `furlong`
commands that do not use environments do not pay for them.
"""
