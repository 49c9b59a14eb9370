"""The leaf every other folder may import: the contracts furlong's processes share.

- `sample`     the Sample (one trajectory) and its invariants
- `api`        the engine HTTP API: paths, pause modes, request models, errors
- `client`     the one engine client (generation and control, async and sync)
- `tool_calls` the one `<tool_call>` parser
- `plugins`    the one plug-point loader
- `net`, `app_thread`  a free port; one FastAPI app served in a thread

Nothing here imports any other furlong folder.
"""
