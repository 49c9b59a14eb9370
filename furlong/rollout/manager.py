"""RolloutManager: prompts in, train batches out — sync, one-step overlap or fully async.

The driver's loop is the same in every mode:

    batch = await manager.next_batch(step)        # exactly B groups x n samples
    ... train on batch ...
    await manager.before_weight_sync()
    ... push weights to the engines, version v ...
    await manager.on_weights_updated(v)
    metrics = await manager.maybe_evaluate(step)

What changes between modes is only who waits for whom (DESIGN §2):

- **sync**: generation runs only inside `next_batch`; groups generated beyond the
  batch (over-sampling surplus) are aborted when it returns and generated again,
  on the new weights, next step. Staleness bound 0.
- **overlap**: when `next_batch` returns, the next batch's prompts are already
  launched, so they generate while the trainer trains. Staleness bound 1 (or
  `max_staleness` if larger).
- **async**: a producer keeps taking prompts into the bounded buffer (back-pressure: it waits for space;
  the groups `next_batch` waits for do not count) and generating them. Staleness bound `max_staleness`.

Ordering and staleness. Groups are consumed in the order their prompts were taken,
never in the order they finish. A group whose oldest policy token is more than the
bound behind the trainer's version is stale: with `stale_policy=retry` its stale
samples are generated again in place (same prompt, same seeds, new weights), with
`drop` it is dropped with the reason `stale`. Seeds derive from (seed, prompt
index, position in the prompt stream, sample index, tokens so far), never from
timing, so async with `max_staleness=0` trains exactly the samples sync does.

Per-sample backfill: a group is finished when all its samples are; a sample the
engine failed (transport errors past the client's retries, a bad response) is
generated again alone, up to `max_sample_attempts` (a failure during an outage, when
nothing can serve, is waited out and not counted), then the group is dropped as `failed`.
An aborted sample is resumed from its tokens so far when `partial_rollout` is on (and its
tokens are still fresh enough), else restarted. Groups dropped `max_dropped_batches`
batches' worth in a row stop the run with the reasons (`filters.check_stalled`).

Partial rollout: `before_weight_sync()` stops new requests and aborts this manager's
requests in flight; the engine returns the tokens generated so far, and after
`on_weights_updated()` each sample continues from prompt + those tokens, so its
`token_versions` show the mix of versions. Without it, requests in flight carry on
through the sync (the driver pauses the engines in retract or in_place mode).

Plug points arrive as functions (PLUG_ARGS), loaded and checked once by the composition
root, so the manager imports nothing above its floor (a black-box `rollout.agent_fn`
comes as the generate function that runs it) and a path it was not handed is an error.

Accounting: every prompt taken is trained, filtered with a reason, or still in the
buffer — `stats()["balanced"]` checks `prompts_taken == groups_trained +
sum(filtered) + in_buffer`; regenerations are counted separately, by reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from furlong.core import spans
from furlong.core.client import EngineClient
from furlong.core.sample import Sample, Status
from furlong.core.version import WeightVersion
from furlong.data.chat import encode_prompt
from furlong.rollout.buffer import TERMINAL, Group, GroupBuffer
from furlong.rollout.eval import evaluate
from furlong.rollout.filters import apply_sample_filter, check_stalled, group_drop_reason, zero_variance
from furlong.rollout.generate import RolloutContext, derive_seed, generate, reset_response, sampling_params
from furlong.rollout.plugs import PLUG_ARGS, RolloutExhausted, check_given
from furlong.rollout.rewards import SCORABLE, call, score_group, score_sample, task_reward

if TYPE_CHECKING:
    from furlong.config.schema import EnvsConfig, RolloutConfig

MODES = ("sync", "overlap", "async")
COUNTED = ("sample_restarts", "partial_aborts", "partial_resumes", "generate_errors", "outage_retries")
COUNTED += ("reward_errors", "evals")  # the counters `stats()` reports as they stand
STATE_VERSION = 1


class RolloutManager:
    """See the module docstring. `config` is the `rollout` config section (or any object with its fields)."""

    def __init__(
        self,
        config: RolloutConfig,
        data_source: Any,
        client: EngineClient,
        tokenizer: Any = None,
        *,
        seed: int = 0,
        eval_prompts: list[Any] | None = None,
        initial_version: int = 0,
        max_sample_attempts: int = 3,
        envs: EnvsConfig | None = None,
        generate_fn: Callable[..., Any] | None = None,
        reward_fn: Callable[..., Any] | None = None,
        group_reward_fn: Callable[..., Any] | None = None,
        dynamic_filter_fn: Callable[..., Any] | None = None,
        sample_filter_fn: Callable[..., Any] | None = None,
        reward_post_fn: Callable[..., Any] | None = None,
        eval_fn: Callable[..., Any] | None = None,
        buffer_factory: Callable[[int], Any] | None = None,
        weights: WeightVersion | None = None,
        serving: Callable[[], Awaitable[bool]] | None = None,
    ):
        """`weights`: the run's weight-version owner (the driver's); without one the manager keeps its own,
        starting at `initial_version`. `reward_post_fn` reshapes each whole batch's rewards before training.
        `serving`: the supervisor's `wait_serving` (True when it had to wait): an outage delays prompts.

        The plug points come as functions (see PLUG_ARGS), each None for the built-in: `generate`, the
        task's reward, `zero_variance` when `dynamic_filter` is on, the built-in eval, `GroupBuffer`.
        `rollout.agent_fn` is run by the generate function the caller passes (`furlong.envs.agent.generate`)."""
        c = config
        check_given(c, {arg: value for arg, value in locals().items() if arg in PLUG_ARGS})  # the plug-point kwargs
        if c.mode not in MODES:
            raise ValueError(f"rollout.mode: must be one of {MODES}, got {c.mode!r}")
        if c.rollout_batch_size < 1 or c.n_samples_per_prompt < 1:
            raise ValueError("rollout.rollout_batch_size and rollout.n_samples_per_prompt must be >= 1")
        if c.over_sampling < 1.0:
            raise ValueError(f"rollout.over_sampling: must be >= 1.0, got {c.over_sampling}")
        self.config = config
        self.mode: str = c.mode
        self.data_source = data_source
        self.client = client
        self.ctx = RolloutContext(client=client, tokenizer=tokenizer, config=config, envs=envs)
        self.seed = seed
        self.eval_prompts = list(eval_prompts or [])
        self.max_sample_attempts = max_sample_attempts
        self.serving = serving
        self.window = math.ceil(c.rollout_batch_size * c.over_sampling)
        capacity = self.window
        if self.mode == "async":  # as many windows as may be in flight unstale: more would be regenerated
            capacity = c.max_buffer_groups or max(1, c.max_staleness) * self.window
        self.buffer = (buffer_factory or GroupBuffer)(capacity)
        self.bound = {"sync": 0, "overlap": max(1, c.max_staleness), "async": c.max_staleness}[self.mode]
        # Sync never drops its over-sampling surplus: it is regenerated on the new weights.
        self.stale_policy = "retry" if self.mode == "sync" else c.stale_policy
        self.partial = bool(c.partial_rollout)

        self.generate_fn = generate_fn or generate
        self.group_reward_fn = group_reward_fn
        self.reward_fn = reward_fn
        if self.reward_fn is None and self.group_reward_fn is None:
            self.reward_fn = task_reward
        self.dynamic_filter_fn = dynamic_filter_fn
        if self.dynamic_filter_fn is None and c.dynamic_filter:
            self.dynamic_filter_fn = zero_variance
        self.sample_filter_fn = sample_filter_fn
        self.eval_fn = eval_fn
        self.reward_post_fn = reward_post_fn

        self._own_weights = weights is None  # a manager alone (tests, tools) owns its version; in a run the driver does
        self.weights = WeightVersion(initial_version) if weights is None else weights
        self._next_seq = self._groups_emitted = 0
        self._counts, self._filtered, self._regenerated, self._masked = (Counter[str]() for _ in range(4))
        self._running = asyncio.Event()  # cleared while weights sync (and in sync mode between steps)
        self._pushed = asyncio.Event()
        self._producer: asyncio.Task | None = None
        self._exhausted = False

    @property
    def version(self) -> int:
        """The weight version the engines serve (asked of the owner): staleness is measured against it."""
        return self.weights.current

    # ---- the driver's API --------------------------------------------------
    def engines_idle(self) -> bool:
        """No engine work before the next `next_batch`: every group's task done (a sample between turns looks finished)."""
        full = self.mode != "async" or self._exhausted or len(self.buffer) >= self.buffer.capacity
        return full and not self.client.inflight and all(g.task is not None and g.task.done() for g in self.buffer)

    async def next_batch(self, step: int) -> list[Sample]:
        """The next `rollout_batch_size` groups (in prompt order) as one flat list of samples."""
        self._running.set()
        self.client.release()
        if self.mode == "async" and self._producer is None:
            self._producer = asyncio.create_task(self._produce())
        try:
            accepted = await self._accept(step, self.config.rollout_batch_size)
        finally:
            self._claim(0)
        if self.mode == "sync":
            await self._stop_generation(cancel=True)
        elif self.mode == "overlap":
            self._fill(self.window)  # batch k+1 generates while batch k trains
        batch = self._emit(accepted, step)
        if self.reward_post_fn is not None:  # reward shaping over the whole batch, once it is formed
            for s, r in zip(batch, await call(self.reward_post_fn, batch), strict=True):
                s.reward = float(r)
        return batch

    async def _accept(self, step: int, B: int) -> list[Group]:
        """Take groups off the head, in prompt order, until `B` pass the staleness bound and the filters."""
        accepted: list[Group] = []
        dropped: Counter[str] = Counter()  # groups dropped since the last one accepted, by reason
        self._claim(B)
        while len(accepted) < B:
            if self.mode != "async":
                self._fill(math.ceil((B - len(accepted)) * self.config.over_sampling))
            t_wait = time.time()
            group = await self._head()
            if self.mode != "sync":  # waiting on the buffer (in sync mode this wait is the generation itself)
                spans.record("driver", "buffer-wait", t_wait, time.time(), merge=True, groups=1)
            if group is None:
                raise RolloutExhausted(f"data source exhausted: {len(accepted)} of {B} groups for step {step}")
            if self._is_stale(group):
                if self.stale_policy == "retry":
                    self._regenerate_stale(group)
                    continue
                self.buffer.popleft()
                self._filtered["stale"] += 1
                continue
            self.buffer.popleft()
            reason = await group_drop_reason(group.samples, self.dynamic_filter_fn)
            if reason is not None:
                self._filtered[reason] += 1
                dropped[reason] += 1
                check_stalled(dropped, self.config, step, len(accepted))
                continue
            self._masked.update(await apply_sample_filter(group.samples, self.sample_filter_fn))
            accepted.append(group)
            self._claim(B - len(accepted))
            dropped.clear()
        return accepted

    def _claim(self, n: int) -> None:
        """Fully async under a staleness bound: the `n` groups this batch still waits for stop counting against
        the buffer's capacity (`GroupBuffer.claim`), so the next window starts during this batch's tail."""
        if self.mode == "async" and self.bound >= 1:
            self.buffer.claim(n)

    async def before_weight_sync(self) -> None:
        """Stop new requests; with partial rollout, abort ours in flight (they resume afterwards)."""
        self._running.clear()
        self.client.hold()
        if self.partial:
            self._counts["partial_aborts"] += await self.client.abort_inflight()

    async def on_weights_updated(self, version: int) -> None:
        """The engines now serve `version`: staleness is measured against it; generation resumes."""
        if version < self.version:
            raise ValueError(f"on_weights_updated: version {version} is older than {self.version}")
        self.weights.advance(version)  # a no-op when the run's owner already holds it (the sync moved it)
        if self.mode != "sync":  # sync generates only inside next_batch
            self._running.set()
            self.client.release()

    async def maybe_evaluate(self, step: int) -> dict[str, float] | None:
        """Eval metrics when `eval_every` divides `step` (and held-out prompts were given), else None."""
        every = self.config.eval_every
        if not self.eval_prompts or not every or step % every:
            return None
        return await self.evaluate(step)

    async def evaluate(self, step: int = 0, client: EngineClient | None = None) -> dict[str, float]:
        """Held-out metrics: `rollout.eval_fn` if given, else pass@k over `eval_n_samples` samples and greedy accuracy.

        An eval function is called as the registry's `EvalFn` protocol says: (ctx, [(prompt, prompt ids)]) and
        every offered keyword (n_samples, sampling_params, reward_fn, generate_fn, seed, step); one loaded
        through the registry sees only those it declares. `client`: evaluate another engine's model (a
        distillation teacher) on the same prompts; None: the policy's engines."""
        held = client is None and not self._running.is_set()  # another client's eval leaves ours alone (mid-rollout)
        if client is None:  # our eval runs between steps, when sync mode holds our client
            self.client.release()
        pairs = [(p, self._encode(p)) for p in self.eval_prompts]
        offered = {
            "n_samples": self.config.eval_n_samples,
            "sampling_params": sampling_params(self.config),
            "reward_fn": self.reward_fn or task_reward,
            "generate_fn": self.generate_fn,
            "seed": self.seed,
        }
        try:
            ctx = self.ctx if client is None else dataclasses.replace(self.ctx, client=client)
            if self.eval_fn is not None:  # the `EvalFn` protocol: (ctx, pairs) plus the offered keywords
                metrics = await call(self.eval_fn, ctx, pairs, **offered, step=step)
            else:
                metrics = await evaluate(ctx, pairs, **offered)
        finally:
            if held:
                self.client.hold()
        self._counts["evals"] += 1
        return metrics

    async def close(self) -> None:
        """Stop the producer and every request of this manager; the buffer stays for `state_dict()`."""
        if self._producer is not None:
            self._producer.cancel()
            await asyncio.gather(self._producer, return_exceptions=True)
            self._producer = None
        await self._stop_generation(cancel=True)
        self.client.release()  # the client may serve others after this manager

    # ---- accounting and state -------------------------------------------------
    def stats(self) -> dict[str, Any]:
        taken = self._counts["prompts_taken"]
        trained = self._counts["groups_trained"]
        filtered = sum(self._filtered.values())
        return {
            "mode": self.mode,
            "version": self.version,
            "steps": self._counts["steps"],
            "prompts_taken": taken,
            "groups_trained": trained,
            "samples_trained": self._counts["samples_trained"],
            "filtered": dict(self._filtered),
            "in_buffer": len(self.buffer),
            "balanced": taken == trained + filtered + len(self.buffer),
            "regenerated": dict(self._regenerated),
            "samples_masked": dict(self._masked),
            **{k: self._counts[k] for k in COUNTED},
            "requests": self.client.requests,
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: buffer (partial samples included), counters, version and the data cursor.

        Safe at any moment: a sample changes only when a response arrives, so a request
        in flight is simply not in the snapshot, and is generated again after a load.
        """
        return {
            "version": STATE_VERSION,
            "mode": self.mode,
            "weight_version": self.version,
            "next_seq": self._next_seq,
            "groups_emitted": self._groups_emitted,
            "counts": dict(self._counts),
            "filtered": dict(self._filtered),
            "regenerated": dict(self._regenerated),
            "masked": dict(self._masked),
            "buffer": self.buffer.state_dict(),
            "data_source": self.data_source.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"RolloutManager.load_state_dict: state version {state.get('version')!r}, expected {STATE_VERSION}"
            )
        if len(self.buffer) or self._producer is not None:
            raise RuntimeError("RolloutManager.load_state_dict: call it before the first next_batch")
        if self._own_weights:  # in a run the driver restores its owner from its own checkpoint state
            self.weights.restore(int(state["weight_version"]))
        self._next_seq = int(state["next_seq"])
        self._groups_emitted = int(state["groups_emitted"])
        self._counts, self._filtered, self._regenerated, self._masked = (
            Counter(state[k]) for k in ("counts", "filtered", "regenerated", "masked")
        )
        self.buffer.load_state_dict(state["buffer"])
        self.data_source.load_state_dict(state["data_source"])

    # ---- groups -------------------------------------------------------------------
    def _encode(self, prompt: Any) -> list[int]:
        ids = prompt.metadata.get("prompt_ids") if prompt.metadata else None
        if ids is not None:
            return [int(t) for t in ids]
        return encode_prompt(self.ctx.tokenizer, prompt.prompt, tools=(prompt.metadata or {}).get("tools"))

    def _new_group(self, prompt: Any) -> Group:
        ids = self._encode(prompt)
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self._counts["prompts_taken"] += 1
        samples = [
            Sample(
                prompt=prompt.prompt,
                tokens=list(ids),
                label=prompt.label,
                metadata={**(prompt.metadata or {}), "prompt_index": prompt.index, "sample_index": j, "seq": seq},
            )
            for j in range(self.config.n_samples_per_prompt)
        ]
        return Group(seq=seq, prompt_index=prompt.index, samples=samples)

    def _take(self, n: int) -> int:
        """Take up to `n` prompts into the buffer; returns how many came."""
        prompts = self.data_source.next_batch(n) if n > 0 else []
        if len(prompts) < n:
            self._exhausted = True
        for p in prompts:
            self.buffer.push(self._new_group(p))
        return len(prompts)

    def _fill(self, target: int) -> None:
        """Sync and overlap: make sure the first `target` groups exist and are generating."""
        target = min(target, self.buffer.capacity)
        if not self._exhausted:
            self._take(target - len(self.buffer))
        for i in range(min(target, len(self.buffer))):
            self._launch(self.buffer[i])

    async def _produce(self) -> None:
        """Async mode: keep the buffer full, one prompt at a time, waiting for space."""
        while not self._exhausted:
            await self.buffer.wait_for_space()
            if self._take(1):
                self._launch(self.buffer[len(self.buffer) - 1])
            self._pushed.set()

    async def _head(self) -> Group | None:
        """The oldest group, once it has finished generating (None when no more will come)."""
        while not len(self.buffer):
            if self._exhausted:
                return None
            self._pushed.clear()
            await self._pushed.wait()
        group = self.buffer[0]
        self._launch(group)
        await asyncio.shield(group.task)
        return group

    def _launch(self, group: Group) -> None:
        if group.task is None or (group.task.done() and (group.task.cancelled() or not group.finished)):
            group.task = asyncio.create_task(self._run_group(group))

    def _is_stale(self, group: Group) -> bool:
        oldest = group.oldest_version()
        return oldest is not None and self.version - oldest > self.bound

    def _regenerate_stale(self, group: Group) -> None:
        """Retry in place: generate again only the samples with a token beyond the bound."""
        for s in group.samples:
            oldest = s.oldest_version()
            if oldest is not None and self.version - oldest > self.bound:
                reset_response(s)
        group.regenerations += 1
        self._regenerated["stale"] += 1
        group.task = asyncio.create_task(self._run_group(group))

    async def _stop_generation(self, *, cancel: bool) -> None:
        """Hold and abort every request of this manager; optionally cancel the group tasks too."""
        self._running.clear()
        self.client.hold()
        await self.client.abort_inflight()
        if cancel:
            tasks = [g.task for g in self.buffer if g.task is not None and not g.task.done()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for g in self.buffer:
                if g.task is not None and g.task.cancelled():
                    g.task = None

    # ---- samples ------------------------------------------------------------------
    async def _run_group(self, group: Group) -> None:
        await asyncio.gather(*(self._run_sample(group, j) for j in range(len(group.samples))))
        if self.group_reward_fn is not None and all(Status(s.status) in SCORABLE for s in group.samples):
            if not await score_group(group.samples, self.group_reward_fn):
                self._counts["reward_errors"] += 1

    async def _run_sample(self, group: Group, j: int) -> None:
        s = group.samples[j]
        failures = 0
        while Status(s.status) not in TERMINAL:
            await self._running.wait()
            if Status(s.status) == Status.ABORTED:
                oldest = s.oldest_version()
                if self.partial and oldest is not None and self.version - oldest <= self.bound:
                    self._counts["partial_resumes"] += 1
                else:
                    reset_response(s)
                    self._counts["sample_restarts"] += 1
            params = {
                **sampling_params(self.config),
                "seed": derive_seed(self.seed, group.prompt_index, group.seq, j, s.response_length),
            }
            try:
                s = group.samples[j] = await self.generate_fn(self.ctx, s, params)
                if Status(s.status) == Status.PENDING:
                    raise RuntimeError("the generate function returned the sample with status 'pending'")
            except Exception as e:  # noqa: BLE001 - the engine's error becomes the sample's reason
                self._counts["generate_errors"] += 1
                if self.serving is not None and await self.serving():
                    self._counts["outage_retries"] += 1  # nothing could serve: not one of the sample's attempts
                    continue
                failures += 1
                if failures >= self.max_sample_attempts:
                    s.status = Status.FAILED
                    s.status_reason = f"generate failed {failures} times; last: {type(e).__name__}: {e}"
        if self.reward_fn is not None and Status(s.status) in SCORABLE and s.reward is None:
            if not await score_sample(s, self.reward_fn):
                self._counts["reward_errors"] += 1

    def _emit(self, groups: list[Group], step: int) -> list[Sample]:
        out = []
        for g in groups:
            gi, self._groups_emitted = self._groups_emitted, self._groups_emitted + 1
            for j, s in enumerate(g.samples):
                s.group_index, s.index = gi, gi * len(g.samples) + j
                oldest = s.oldest_version()
                s.metadata.update(step=step, staleness=None if oldest is None else self.version - oldest)
                out.append(s.validate())
        self._counts["steps"] += 1
        self._counts["groups_trained"] += len(groups)
        self._counts["samples_trained"] += len(out)
        return out
