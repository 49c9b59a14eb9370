"""The rollout manager against a real `furlong serve` process with a tiny model.

Proves, on the real engine: single-turn rollouts carry the model's true log-probs
(equal to HF's log-softmax) and the engine's weight version; seeded requests give
the same samples whatever the concurrency; and a partial rollout aborted at a
weight sync resumes from its tokens so far, keeping their log-probs and versions.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from furlong.config.schema import RolloutConfig
from furlong.core.client import EngineClient
from furlong.core.sample import Status
from furlong.data import TASKS, DataSource
from furlong.models import load_tokenizer
from furlong.rollout.generate import generate
from furlong.rollout.manager import RolloutManager
from tests.helpers import engine_process

TOKEN = "rollout-test-token"


def Cfg(**kw):
    """The real `rollout` config section, with this file's small defaults."""
    return RolloutConfig(**{"rollout_batch_size": 2, "max_new_tokens": 16, **kw})


@pytest.fixture(scope="module")
def server():
    with engine_process(TOKEN) as (url, path):
        yield url, path


@pytest.fixture(scope="module")
def hf(server):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(server[1], dtype=torch.float32).eval()


def hf_logprobs(model, tokens: list[int], prompt_length: int) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[i - 1, tokens[i]].item() for i in range(prompt_length, len(tokens))]


def weight_version(url: str) -> int:
    return httpx.get(url + "/get_weight_version").json()["weight_version"]


@pytest.mark.timeout(180)
def test_single_turn_rollout_has_real_logprobs_and_is_order_free(server, hf):
    url, path = server
    tok = load_tokenizer(path)
    prompts = TASKS["arithmetic"].make("train", n=8, seed=0)

    async def rollout(max_inflight: int):
        async with EngineClient(url, admin_token=TOKEN, max_inflight=max_inflight) as client:
            mgr = RolloutManager(Cfg(), DataSource(prompts, seed=0), client, tok, seed=11)
            batch = await mgr.next_batch(0)
            stats = mgr.stats()
            await mgr.close()
            return batch, stats

    batch, stats = asyncio.run(rollout(16))
    version = weight_version(url)
    assert len(batch) == 8 and stats["balanced"] and stats["groups_trained"] == 2
    for s in batch:
        s.validate()
        assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.response_length >= 1
        assert s.tokens[: s.prompt_length] == tok.encode(s.prompt, add_special_tokens=False)
        assert s.token_versions == [version] * s.response_length
        assert s.reward in (0.0, 1.0)  # the arithmetic task's own rule scored the decoded text
        assert s.metadata["response_text"] == tok.decode(s.response_tokens, skip_special_tokens=True)
        assert s.rollout_logprobs == pytest.approx(hf_logprobs(hf, s.tokens, s.prompt_length), abs=1e-4)
    # per-(prompt, sample) seeds: one request at a time gives exactly the same samples
    serial, _ = asyncio.run(rollout(1))
    assert [s.tokens for s in serial] == [s.tokens for s in batch]


@pytest.mark.timeout(180)
def test_partial_rollout_resumes_across_an_abort(server, hf):
    url, path = server
    tok = load_tokenizer(path)
    prompts = TASKS["arithmetic"].make("train", n=8, seed=1)

    async def long_generate(ctx, sample, params):
        # run to the token budget so requests are surely in flight at the sync
        return await generate(ctx, sample, {**params, "ignore_eos": True})

    async def main():
        cfg = Cfg(
            mode="async",
            rollout_batch_size=1,
            n_samples_per_prompt=2,
            max_new_tokens=200,
            partial_rollout=True,
            max_staleness=3,
            max_buffer_groups=2,
        )
        async with EngineClient(url, admin_token=TOKEN) as client:
            mgr = RolloutManager(
                cfg,
                DataSource(prompts, seed=0),
                client,
                tok,
                generate_fn=long_generate,
                reward_fn=lambda s: float(s.response_length),
                initial_version=weight_version(url),
            )
            await mgr.next_batch(0)
            for step in range(1, 8):
                # let the producer get some tokens of the next group in flight (unless it is already done)
                while not client.inflight and (mgr.buffer.free or not all(g.finished for g in mgr.buffer)):
                    await asyncio.sleep(0.005)
                await asyncio.sleep(0.05)
                await mgr.before_weight_sync()  # aborts those requests: they return their tokens so far
                async with httpx.AsyncClient() as http:
                    r = await http.post(
                        url + "/update_weights_from_disk",
                        json={"model_path": str(path)},
                        headers={"Authorization": f"Bearer {TOKEN}"},
                    )
                assert r.status_code == 200, r.text
                await mgr.on_weights_updated(r.json()["weight_version"])
                batch = await mgr.next_batch(step)
                mixed = [s for s in batch if len(set(s.token_versions)) > 1]
                if mixed:
                    break
            stats = mgr.stats()
            await mgr.close()
            return mixed, stats, mgr.version

    mixed, stats, version = asyncio.run(main())
    assert mixed, "no sample was resumed across the weight sync"
    assert stats["partial_aborts"] >= 1 and stats["partial_resumes"] >= 1 and stats["balanced"]
    for s in mixed:
        s.validate()
        assert s.status == Status.TRUNCATED and s.response_length == 200
        assert s.token_versions == sorted(s.token_versions) and version - s.token_versions[0] <= 3
        # same weights reloaded: every token's log-prob — before and after the resume — is the model's
        assert s.rollout_logprobs == pytest.approx(hf_logprobs(hf, s.tokens, s.prompt_length), abs=1e-4)
