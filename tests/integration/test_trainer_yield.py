"""Time-shared cores: the rollout engines freeze in place while the trainer computes, and go on after.

A real engine process; `EngineYield.trainer_computing()` (furlong/cluster/core_sharing.py) around a
stand-in train step. While the engine is frozen a request in flight keeps its place (paused "in_place",
no engine step is taken, a new request is queued, not refused); after it, both finish with every token.
With the cores not time-shared the same block leaves the engine running.

Lent cores (`cluster.lend_idle_cores`): the same block sets the engine's threads to its share and back
to every core after, while it keeps decoding.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets

import httpx
import pytest

from furlong.cluster.core_sharing import EngineYield
from tests.helpers import engine_process


async def engine_state(http: httpx.AsyncClient, url: str) -> tuple[str | None, int]:
    """(paused mode, engine steps taken so far)."""
    info = (await http.get(url + "/get_server_info")).json()
    steps = re.search(r"^furlong_engine_steps_total (\d+)", (await http.get(url + "/metrics")).text, re.M)
    return info["paused"], int(steps.group(1))


async def until(predicate, what: str, timeout_s: float = 60.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(240)
def test_engines_freeze_in_place_while_the_trainer_computes():
    token = secrets.token_hex(8)
    with engine_process(token, "--max-context", "2048") as (url, _):

        async def main():
            sup = EngineYield(lambda: [url], token, enabled=True)
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
            async with httpx.AsyncClient(timeout=120) as http:
                try:
                    first = asyncio.create_task(http.post(url + "/generate", json=body))
                    start = (await engine_state(http, url))[1]
                    await until(lambda: _moved(http, url, start), "decoding")
                    async with sup.trainer_computing():
                        paused, frozen_at = await engine_state(http, url)
                        assert paused == "in_place"
                        second = asyncio.create_task(http.post(url + "/generate", json=body))
                        await asyncio.sleep(1.0)  # an engine that were still running would take steps meanwhile
                        assert await engine_state(http, url) == ("in_place", frozen_at)
                        assert not first.done() and not second.done()
                    assert (await engine_state(http, url))[0] is None
                    for done in await asyncio.gather(first, second):
                        assert done.status_code == 200, done.text
                        assert done.json()["meta_info"]["completion_tokens"] == 2000
                    assert sup.yields == 1

                    running = EngineYield(lambda: [url], token, enabled=False)
                    async with running.trainer_computing():
                        assert (await engine_state(http, url))[0] is None  # not time-shared: nothing paused
                    assert running.yields == 0
                finally:
                    await sup.aclose()

        asyncio.run(main())


async def threads(http: httpx.AsyncClient, url: str) -> int:
    return (await http.get(url + "/get_server_info")).json()["threads"]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="lending a core needs two")
@pytest.mark.timeout(240)
def test_lent_cores_go_back_to_the_trainer_while_it_computes():
    token = secrets.token_hex(8)
    with engine_process(token, "--max-context", "1024") as (url, _):  # started with one thread, as split

        async def main():
            lend = EngineYield(lambda: [url], token, enabled=False, lend=(1, 2))
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
            auth = {"Authorization": f"Bearer {token}"}
            async with httpx.AsyncClient(timeout=120) as http:
                try:
                    assert await threads(http, url) == 1
                    await lend.start()
                    assert await threads(http, url) == 2  # the trainer waits for its first batch: every core
                    first = asyncio.create_task(http.post(url + "/generate", json=body))
                    start = (await engine_state(http, url))[1]
                    await until(lambda: _moved(http, url, start), "decoding")
                    async with lend.trainer_computing():
                        assert await threads(http, url) == 1
                        paused, at = await engine_state(http, url)
                        assert paused is None  # lent cores taken back, nothing frozen: it keeps decoding
                        await until(lambda: _moved(http, url, at), "decoding while the trainer computes")
                    assert await threads(http, url) == 2 and lend.yields == 1
                    done = await first
                    assert done.status_code == 200 and done.json()["meta_info"]["completion_tokens"] == 1000
                    too_many = await http.post(url + "/set_threads", json={"threads": 100_000}, headers=auth)
                    assert too_many.status_code == 400 and "threads" in too_many.text
                    assert (await http.post(url + "/set_threads", json={"threads": 1})).status_code == 401
                finally:
                    await lend.aclose()

        asyncio.run(main())
    with pytest.raises(ValueError, match="not both"):
        EngineYield(lambda: [], "t", enabled=True, lend=(1, 2))


async def _moved(http: httpx.AsyncClient, url: str, start: int) -> bool:
    return (await engine_state(http, url))[1] > start
