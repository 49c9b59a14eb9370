"""The `examples/agent_openai_client` agent as the `rollout.agent_fn` plug point, on a real session server.

The engine behind the sessions is scripted (it calls the calculator, then answers),
so the test shows the whole tool loop through the official `openai` client: the
agent runs the tool, the session records the episode as one Sample, and the agent's
reward reads the final answer.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import httpx

from furlong.config.registry import load_plugin
from furlong.core.sample import Sample
from furlong.envs.session_server import ServerThread, SessionServer
from furlong.models import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from envs_scripted_engine import Script, Turn  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_openai_client" / "agent.py"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34 + 56"}}</tool_call>'


def test_example_agent_solves_with_the_tool(tiny_model_dir):
    spec = importlib.util.spec_from_file_location("agent_openai_client", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tok = load_tokenizer(tiny_model_dir)
    script = Script(tok, [Turn(CALL), Turn("Answer: 464")])
    with ServerThread(SessionServer("http://engine", tok, transport=script.transport())) as sessions:
        sid = httpx.post(sessions.url + "/sessions").json()["id"]
        task = Sample(prompt=[{"role": "user", "content": "Use the calculator to compute 12 * 34 + 56."}], label=464)
        reward = asyncio.run(example.agent(task, sessions.session_url(sid)))
        [recorded] = [
            Sample.from_dict(d).validate() for d in httpx.get(f"{sessions.url}/sessions/{sid}/samples").json()
        ]
    assert reward == 1.0
    assert "<tool_response>464</tool_response>" in tok.decode(recorded.response_tokens)
    assert recorded.token_sources.count("tool") == len(tok.encode("464", add_special_tokens=False))
    assert recorded.metadata["turns"] == 2 and recorded.metadata["template_mismatch"] is False
    # It fits the plug point's signature as furlong checks it at start.
    sys.modules["agent_openai_client"] = example
    assert load_plugin("rollout.agent_fn", "agent_openai_client:agent") is example.agent
