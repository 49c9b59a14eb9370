"""The trainer: one rank of FSDP2 training over a HF causal LM.

A plain class, so tests drive it in-process and the Ray actor group later wraps one instance per rank. Every
rank receives the *whole* global batch and takes its own deterministic shard: group-normalised advantages need
whole groups, every rank can then plan every rank's micro-batches without talking, and the global-batch counts
are known locally. The loss hub's reducers divide by those global counts (`total_tokens`, `total_samples`), so
each micro-batch's loss is its exact share of the global loss and N ranks × k micro-batches reproduce one big
batch (tested: accumulation and world size 2 against world size 1). FSDP averages gradients over ranks, so each
rank backpropagates `loss_mb · world_size`.

Micro-batches are packed rows (see `batch.py`) under `micro_batch_tokens`; all
ranks run the same number (a rank short of samples runs a zero-weight dummy) so
FSDP's collectives line up.

Log-probs are taken at the rollout temperature (log_softmax(logits / T)), so
the ratio against the engine's log-probs compares like with like.

Plug points arrive resolved (`TrainerHooks`, from the driver's composition root):
the trainer reads typed config sections and calls functions, never dotted paths.
"""

from __future__ import annotations

import importlib
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from furlong.core import spans
from furlong.core.sample import Sample, SampleError
from furlong.train import checkpoint, compiled, cpu_attention, dist, mfu, onednn_linear, qat, routing_replay
from furlong.train.batch import Packed, TrainBatch, micro_batches, pack, partition
from furlong.train.critic import ValueModel
from furlong.train.hooks import TrainerHooks
from furlong.train.lora import adapter_items, apply_lora, lora_dict, merged_items
from furlong.train.multi_lora import MultiLora
from furlong.train.optim import build_optimizer, build_scheduler
from furlong.train.threads import LEASE

if TYPE_CHECKING:
    from furlong.config.schema import AlgoConfig, TrainConfig

log = logging.getLogger("furlong.train")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DUMMY = Packed(
    torch.zeros(1, 2, dtype=torch.long), torch.arange(2)[None], *[torch.zeros(1, dtype=torch.long)] * 4, (1, 1), 2
)


def _summed(metric: str) -> bool:
    """Loss parts are each micro-batch's share of the global loss, and counts are counts: both add up."""
    return metric.startswith("loss/") or metric.endswith("num_tokens")


class Trainer:
    def __init__(
        self,
        model_dir: str | Path,
        train_cfg: TrainConfig,
        algo_cfg: AlgoConfig,
        rank: int = 0,
        world_size: int = 1,
        *,
        temperature: float = 1.0,
        seed: int = 0,
        hooks: TrainerHooks | None = None,
        losses: ModuleType | None = None,
    ) -> None:
        """`seed` initialises adapters and the value head (the same on every rank); `hooks` are the resolved
        plug points (None: every one built in); `losses` is the loss hub (a module with `compute_advantages`,
        `compute_policy_objective`, `kl_estimate`, `sft_loss`)."""
        if temperature <= 0:
            raise ValueError(f"rollout temperature must be > 0 for training log-probs, got {temperature}")
        if train_cfg.dtype not in DTYPES:
            raise ValueError(f"train.dtype: {train_cfg.dtype!r} is not one of {list(DTYPES)}")
        self.cfg, self.algo = train_cfg, algo_cfg
        self.model_dir = str(model_dir)
        self.rank, self.world_size = rank, world_size
        self.temperature = float(temperature)
        self.losses = losses if losses is not None else importlib.import_module("furlong.train.losses")
        self.device = dist.init(rank, world_size, train_cfg.backend)
        self.dtype, self.mixed_precision = DTYPES[train_cfg.dtype], train_cfg.mixed_precision  # see dist.distribute
        self.compute_dtype = torch.bfloat16 if self.mixed_precision == "bf16" else self.dtype  # MFU's peak
        # Every user function reports its failures naming its config key (`train.loss_fn`, ...).
        self.hooks = (hooks or TrainerHooks()).named()
        self.convert = self.hooks.convert_fn or TrainBatch.from_samples
        self.lora = lora_dict(train_cfg.lora)
        self.qat = train_cfg.qat  # "int4": policy and reference fake-quantise their linears (see qat.py)
        qat.check_lora(self.qat, self.lora is not None)
        self.kl_coef = float(algo_cfg.kl_coef)
        if algo_cfg.loss_reducer == "constant" and algo_cfg.reducer_constant is None:
            # The hub's fallback (the padded T) would differ between micro-batches and ranks.
            raise ValueError(
                "algo.reducer_constant must be set (e.g. rollout.max_new_tokens) for loss_reducer='constant'"
            )
        torch.manual_seed(int(seed))  # adapter / head init must agree on every rank
        self.compile_clock = compiled.Clock(compiled.wanted(train_cfg.compile, self.device))  # train.compile

        policy = self._load_lm()
        if train_cfg.gradient_checkpointing:
            policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.policy = self._place(apply_lora(policy, self.lora, train_cfg.lora.adapters) if self.lora else policy)
        self.multi_lora = MultiLora.attach(self.policy, train_cfg.lora, train_cfg.num_steps_per_rollout)  # or None
        # The reference policy: a frozen copy; with LoRA, the base itself (adapters switched off).
        self.ref = self._place(self._load_lm(), frozen=True) if self.kl_coef and not self.lora else None
        if self.lora and self.cfg.ref_update_every:
            raise ValueError("train.ref_update_every: not supported with LoRA (the reference is the frozen base)")
        self.critic = self._place(ValueModel(self.model_dir, self.dtype)) if self._needs_critic() else None

        self.optimizer = build_optimizer(self.policy.parameters(), train_cfg)
        self.scheduler = build_scheduler(self.optimizer, train_cfg)
        if self.critic is not None:
            self.critic_optimizer = build_optimizer(self.critic.parameters(), train_cfg, train_cfg.critic_lr)
            self.critic_scheduler = build_scheduler(self.critic_optimizer, train_cfg)
        self.step = 0
        self.seen_logprobs: dict[int, list[float]] = {}
        self.nonfinite_streak = 0  # optimiser steps in a row skipped for a NaN/inf loss or gradient
        self.adv_metrics: dict[str, float] = {}  # the last prepared batch's `advantage/<estimator>/...`

    # ------------------------------------------------------------------ set-up
    def _needs_critic(self) -> bool:
        return self.algo.advantage == "gae" or self.algo.name == "ppo"

    def _load_lm(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
        qat.apply_qat(model, self.qat)
        return model

    def _place(self, model: nn.Module, frozen: bool = False) -> nn.Module:
        model.to(self.device)
        onednn_linear.apply(model, self.cfg.onednn_linear, self.device)  # before sharding (train.onednn_linear)
        cpu_attention.apply(model, self.device)  # fp32 attention where a CPU backward is slow in bf16
        if frozen:
            model.requires_grad_(False).eval()
        dist.distribute(model, self.device, self.world_size, self.mixed_precision)  # FSDP2, or one-rank autocast
        if self.compile_clock.on:
            compiled.compile_layers(model)  # after sharding: FSDP2 units are the layers themselves
        return model

    def _modules(self) -> list[nn.Module]:
        return [m for m in (self.policy, self.critic) if m is not None]

    # ------------------------------------------------------------------ forward
    def _logprobs(self, model: nn.Module, packed: Packed, entropy=False, temperature: float | None = None):
        """Per-token log-probs (and entropy; its gradient only if entropy="grad") `[B, T]`, fp32, at temperature T."""
        logits = routing_replay.replayed(model, packed.routes)(  # R3: the rollout's MoE routes, if recorded
            input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, logits_to_keep=packed.keep
        ).logits
        logp = torch.log_softmax(packed.kept(logits).float() / (temperature or self.temperature), dim=-1)
        lp = packed.scatter(logp.gather(-1, packed.targets[:, None]).squeeze(-1))
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy == "grad"):  # metric only: no [N, V] graph
            ent = packed.scatter(-(logp.exp() * logp).sum(-1)) if entropy else None
        return lp, ent

    def _values(self, packed: Packed) -> Tensor:
        return packed.scatter(self.critic(packed.input_ids, packed.position_ids, packed.flat_index).float())

    def _ref_logprobs(self, packed: Packed) -> Tensor:
        if self.ref is not None:
            return self._logprobs(self.ref, packed)[0]
        with self.policy.disable_adapter():
            return self._logprobs(self.policy, packed)[0]

    # ------------------------------------------------------------------ planning
    def _plan(self, lengths: list[int]) -> list[list[int]]:
        """This rank's micro-batches (global sample indices); the same count on every rank."""
        shards = partition(lengths, self.world_size)
        plan = lambda shard, k=1: micro_batches([lengths[i] for i in shard], self.cfg.micro_batch_tokens, k)
        k = max(1, max(len(plan(shard)) for shard in shards))  # fewer than the busiest: spread thinner, or dummies
        shard = shards[self.rank]
        return [[shard[i] for i in mb] for mb in plan(shard, k)]

    @torch.no_grad()
    def _per_token(self, batch: TrainBatch, fn: Callable[[Packed], Tensor]) -> Tensor:
        """Run `fn` over the batch (each rank its shard) and return the full `[B, T]` result on every rank."""
        B, T = batch.mask.shape
        out = torch.zeros(B, T, device=self.device)
        for idx in LEASE.each(self._plan(batch.seq_lengths)):
            if not idx:
                fn(_DUMMY.to(self.device))
                continue
            vals = fn(pack([batch.samples[i] for i in idx]).to(self.device))
            out[torch.tensor(idx, device=self.device), : vals.shape[1]] = vals.float()
        return dist.all_reduce_sum(out).cpu()  # each row is written by exactly one rank: the sum is exact

    # ------------------------------------------------------------------ public API
    def compute_logprobs(self, samples: list[Sample] | TrainBatch, which: str = "policy") -> list[list[float]]:
        """Per-sample response log-probs under the policy (or `which="ref"`), at the rollout temperature."""
        batch = samples if isinstance(samples, TrainBatch) else self.convert(samples)
        if which not in ("policy", "ref"):
            raise ValueError(f"compute_logprobs: which={which!r} is not 'policy' or 'ref'")
        self.policy.eval()
        fn = self._ref_logprobs if which == "ref" else (lambda p: self._logprobs(self.policy, p)[0])
        lp = self._per_token(batch, fn)
        return [lp[i, : s.response_length].tolist() for i, s in enumerate(batch.samples)]

    def prepare(self, samples: list[Sample] | TrainBatch) -> TrainBatch:
        """Old and reference log-probs, old values, then advantages over the whole batch."""
        batch = samples if isinstance(samples, TrainBatch) else self.convert(samples)
        if batch.rewards is None:
            missing = next(s.index for s in batch.samples if s.reward is None)
            raise SampleError(f"sample {missing}: reward is not set; RL training needs a reward on every sample")
        for m in self._modules():
            m.eval()
        uses_ref = bool(self.kl_coef)
        # With one optimiser step per rollout the training forward's own log-probs are pi_old (ratio 1): no
        # separate pass, unless the KL folded into the reward (or an advantage_fn, which may read it) needs them first.
        kl_first = uses_ref and (self.algo.kl_in_reward or self.hooks.advantage_fn is not None)
        if kl_first or self.cfg.num_steps_per_rollout > 1:
            with self._span("old-logprob"):
                batch.old_logprobs = self._per_token(batch, lambda p: self._logprobs(self.policy, p)[0])
        if uses_ref:
            with self._span("ref-logprob"):
                batch.ref_logprobs = self._per_token(batch, self._ref_logprobs)
        if self.critic is not None:
            batch.old_values = self._per_token(batch, self._values)
        kl = None  # per-token KL to the reference, folded into the reward when algo.kl_in_reward
        if uses_ref and batch.old_logprobs is not None:
            kl = self.losses.kl_estimate(batch.old_logprobs, batch.ref_logprobs, self.algo.kl_type)
        batch.advantages, batch.returns = self.losses.compute_advantages(
            self.algo,
            batch.rewards,
            batch.group_index,
            batch.mask,
            values=batch.old_values,
            kl=kl,
            advantage_fn=self.hooks.advantage_fn,
        )
        tag = getattr(self.losses, "advantage_metrics", None)  # which estimator ran, under its own key
        self.adv_metrics = tag(self.algo, batch.advantages, batch.returns, batch.mask) if tag else {}
        return batch

    def train_rollout(self, samples: list[Sample] | TrainBatch) -> dict[str, Any]:
        """Prepare a rollout batch once, then take `num_steps_per_rollout` optimiser steps over its slices.

        Returns the step's record with its provenance, so the event store can show per token what the
        trainer saw: `metrics` (one dict per optimiser step), `span` (wall-clock start, end), and on
        rank 0 `advantages` and `train_logprobs` (per sample, response tokens only; `train_logprobs`
        only when known for every sample).
        """
        if self.multi_lora is not None and self.multi_lora.active is None:  # each adapter on its samples
            return self.multi_lora.train_rollout(self, samples)
        t0 = time.time()
        self.seen_logprobs = {}  # id(sample) -> train log-probs of this batch, when not in `old_logprobs`
        batch = self.last_batch = self.prepare(samples)
        n = self.cfg.num_steps_per_rollout
        if len(batch) % n:
            raise ValueError(
                f"train.num_steps_per_rollout={n} does not divide the rollout batch of {len(batch)} samples"
            )
        size = len(batch) // n
        metrics = [self.train_step(batch.select(list(range(i * size, (i + 1) * size)))) for i in range(n)]
        metrics = [{**m, **self.adv_metrics} for m in metrics]
        return {"metrics": metrics, "span": (t0, time.time())} | (self._provenance(batch) if self.rank == 0 else {})

    def _provenance(self, batch: TrainBatch) -> dict[str, list[list[float]]]:
        """Per-sample advantages and the trainer's log-probs of the batch just trained, cut to each response."""
        out: dict[str, list[list[float]]] = {}
        n = [s.response_length for s in batch.samples]
        if batch.advantages is not None:
            out["advantages"] = [batch.advantages[i, : n[i]].tolist() for i in range(len(n))]
        if batch.old_logprobs is not None:
            out["train_logprobs"] = [batch.old_logprobs[i, : n[i]].tolist() for i in range(len(n))]
        elif all(id(s) in self.seen_logprobs for s in batch.samples):  # this rank saw every sample
            out["train_logprobs"] = [self.seen_logprobs[id(s)] for s in batch.samples]
        return out

    def train_step(self, batch: list[Sample] | TrainBatch) -> dict[str, float]:
        """One optimiser step of the policy objective (and the critic's, for PPO) on a global batch."""
        if not isinstance(batch, TrainBatch) or batch.advantages is None:
            batch = self.prepare(batch)
        if self.hooks.before_train_step is not None:
            self.hooks.before_train_step(self.step, batch)
        return self._optimise(batch, self._policy_loss)

    def sft_step(self, samples: list[Sample] | TrainBatch) -> dict[str, float]:
        """One optimiser step of supervised fine-tuning: NLL of the loss-masked response tokens (T = 1)."""
        batch = samples if isinstance(samples, TrainBatch) else self.convert(samples)
        sft_lr = self.cfg.sft_lr
        if sft_lr is None:
            return self._optimise(batch, self._sft_loss)
        # A warm-up usually wants a larger step than RL; then every group gets the RL rate back (also if skipped).
        for group in self.optimizer.param_groups:
            group["lr"] = sft_lr
        try:
            return {**self._optimise(batch, self._sft_loss), "lr": float(sft_lr)}
        finally:
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr

    def state_dict_for_sync(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor) pairs of the policy, one at a time; LoRA is merged.

        With train.qat=int4 the QAT layers' weights are sent fake-quantised (on the INT4 grid), not as the
        fp32 masters: an engine serving them computes exactly what training saw (see qat.py).
        Collective under FSDP: every rank must iterate to the end (each gets full tensors).
        """
        items = dist.full_state(self.policy)
        if self.lora and self.cfg.lora.sync == "adapter":  # train.lora.sync: A and B only (train/lora.py)
            yield from adapter_items(self.policy, items, self.multi_lora and self.multi_lora.sync_names())
            return
        yield from qat.sync_items(self.policy, merged_items(self.policy, items) if self.lora else items)

    # ------------------------------------------------------------------ losses
    def _totals(self, batch: TrainBatch) -> dict[str, float]:
        """Global-batch counts the loss hub's reducers divide by, so micro-batch losses are exact shares."""
        reducer = self.algo.loss_reducer
        samples = (batch.mask.sum(1) > 0).sum() if reducer == "sample_mean" else len(batch)
        return {"total_tokens": float(batch.mask.sum()), "total_samples": float(samples)}

    def _policy_loss(self, sub: TrainBatch, packed: Packed, totals: dict[str, float]):
        need = "grad" if self.algo.entropy_coef or self.hooks.loss_fn else True  # else entropy is a metric only
        lp, ent = self._logprobs(self.policy, packed, entropy=need)
        t: dict[str, Any] = {k: v.to(self.device) for k, v in sub.loss_tensors().items()}
        t.update(totals, logprobs=lp, entropy=ent)
        if "old_logprobs" not in t:  # on-policy: this forward's log-probs are the old ones; keep them for provenance
            t["old_logprobs"] = lp.detach()
            for i, s in enumerate(sub.samples):
                self.seen_logprobs[id(s)] = t["old_logprobs"][i, : s.response_length].tolist()
        if self.critic is not None:
            t["values"] = self._values(packed)
        h = self.hooks
        loss, metrics = self.losses.compute_policy_objective(
            self.algo, t, loss_fn=h.loss_fn, correction_fn=h.correction_fn, reducer_fn=h.reducer_fn
        )
        # The ESS ratio is not a token mean: keep its sums so it is exact over the global batch.
        mask = t["mask"]
        rho = torch.exp(((t["old_logprobs"] - t["rollout_logprobs"]) * mask).clamp(-20, 20)) * mask
        return loss, metrics, {"_rho": float(rho.sum()), "_rho2": float((rho * rho).sum())}

    def _sft_loss(self, sub: TrainBatch, packed: Packed, totals: dict[str, float]):
        lp, _ = self._logprobs(self.policy, packed, temperature=1.0)
        # SFT's own reducer is token_mean (a warm-up is plain cross-entropy); a train.reducer_fn replaces it too.
        loss, metrics = self.losses.sft_loss(
            lp,
            sub.mask.to(self.device),
            self.hooks.reducer_fn or "token_mean",
            constant=self.algo.reducer_constant,
            total_tokens=totals["total_tokens"],
            total_samples=totals["total_samples"],
        )
        return loss, metrics, {}

    def _dummy_loss(self) -> Tensor:
        """Zero loss through every trained module, so FSDP's collectives match the other ranks."""
        packed = _DUMMY.to(self.device)
        loss = self._logprobs(self.policy, packed)[0].sum() * 0
        return loss + self._values(packed).sum() * 0 if self.critic is not None else loss

    def _optimise(self, batch: TrainBatch, loss_fn: Callable) -> dict[str, float]:
        t_step, plan = time.perf_counter(), self._plan(batch.seq_lengths)
        compile_mark = self.compile_clock.mark()
        totals = self._totals(batch)
        optimizers = [self.optimizer] + ([self.critic_optimizer] if self.critic is not None else [])
        for m in self._modules():
            m.train()
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        for j, idx in enumerate(LEASE.each(plan)):
            if self.world_size > 1:  # reduce-scatter once, after the last micro-batch
                for m in self._modules():
                    m.set_requires_gradient_sync(j == len(plan) - 1)
            if not idx:
                self._dummy_loss().backward()
                continue
            sub = batch.select(idx)
            with self._span("forward-backward", micro_batch=j, tokens=sum(batch.seq_lengths[i] for i in idx)):
                loss, metrics, own = loss_fn(sub, pack(sub.samples).to(self.device), totals)
                LEASE.backward(loss * self.world_size)  # FSDP averages gradients over ranks; the loss is a share
            tokens = float(sub.mask.sum())
            sums["loss"] += float(loss.detach())
            sums["_tokens"] += tokens
            for k, v in own.items():
                sums[k] += v
            for k, v in metrics.items():
                if _summed(k):
                    sums[k] += float(v)
                elif k.endswith("_max"):
                    sums[k] = max(sums.get(k, float("-inf")), float(v))
                else:
                    sums[k] += float(v) * tokens
                    sums[f"_w/{k}"] += tokens
        t_opt = time.time()  # the optimiser span: clip, metric reduction, the step (or its skip)
        grad_norm = self._clip(self.policy)
        lr = self.scheduler.get_last_lr()[0]
        out = {"grad_norm": grad_norm, "lr": lr}
        if self.critic is not None:
            out["critic/grad_norm"] = self._clip(self.critic)
        out |= self._reduce_metrics(sums, batch) | routing_replay.step_metrics(self.policy)  # r3/*
        # Loss and grad norms are global (gathered / all-reduced), so every rank takes the same branch.
        finite = all(math.isfinite(out[k]) for k in ("loss", "grad_norm", "critic/grad_norm") if k in out)
        if finite:
            self.nonfinite_streak = 0
            for o in optimizers:
                o.step()
            self.scheduler.step()
            if self.critic is not None:
                self.critic_scheduler.step()
        else:  # one NaN/inf update would poison every weight: skip it, the driver stops after too many
            self.nonfinite_streak += 1
            for o in optimizers:
                o.zero_grad(set_to_none=True)
            log.warning(
                "optimiser step %d skipped: loss %s, grad norm %s (%d in a row)",
                self.step,
                out["loss"],
                grad_norm,
                self.nonfinite_streak,
            )
        self._span("optimiser", start=t_opt, finite=finite)
        self.step += 1
        if finite and self.ref is not None and self.cfg.ref_update_every and self.step % self.cfg.ref_update_every == 0:
            with torch.no_grad():
                for r, p in zip(self.ref.parameters(), self.policy.parameters()):
                    r.copy_(p)
        spent = self.compile_clock.report(compile_mark, out)  # perf/compile_s, kept out of the step's MFU
        out |= mfu.for_step(self.policy, self.compute_dtype, self.device, sum(batch.seq_lengths), t_step + spent)
        return out | {
            "step": float(self.step),
            "nonfinite/skipped": float(not finite),
            "nonfinite/streak": float(self.nonfinite_streak),
        }

    def _reduce_metrics(self, sums: dict[str, float], batch: TrainBatch) -> dict[str, float]:
        """Combine micro-batch and rank metrics: shares and counts add, maxima max, the rest token-weighted."""
        total: dict[str, float] = {}
        for part in dist.gather_objects(dict(sums)):
            for k, v in part.items():
                total[k] = max(total[k], v) if k in total and k.endswith("_max") else total.get(k, 0.0) + v
        tokens = total.pop("_tokens", 0.0)
        out = {"loss": total.pop("loss", 0.0), "tokens": tokens, "samples": float(len(batch))}
        rho, rho2 = total.pop("_rho", None), total.pop("_rho2", None)
        for k in [k for k in total if k.startswith("_w/")]:
            weight = total.pop(k)
            out[k[3:]] = total.pop(k[3:]) / max(weight, 1.0)
        out.update(total)
        if rho is not None and rho2:
            out["mismatch/ess_ratio"] = rho * rho / (max(tokens, 1.0) * rho2)
        return out

    def _clip(self, model: nn.Module) -> float:
        params = [p for p in model.parameters() if p.grad is not None]
        clip = self.cfg.grad_clip if self.cfg.grad_clip and self.cfg.grad_clip > 0 else float("inf")
        return float(dist.full_tensor(torch.nn.utils.clip_grad_norm_(params, clip)))

    # ------------------------------------------------------------------ checkpoints
    def _parts(self) -> checkpoint.Stateful:
        parts: checkpoint.Stateful = {"policy": (self.policy, self.optimizer)}
        if self.critic is not None:
            parts["critic"] = (self.critic, self.critic_optimizer)
        if self.ref is not None and self.cfg.ref_update_every:
            parts["ref"] = (self.ref, None)
        return parts

    def save(self, path: str | Path) -> Path:
        """Full state to `path` (collective): see `checkpoint.py` for the layout."""
        rank_state = {"step": self.step, "scheduler": self.scheduler.state_dict()}
        if self.critic is not None:
            rank_state["critic_scheduler"] = self.critic_scheduler.state_dict()
        meta = {
            "step": self.step,
            "world_size": self.world_size,
            "model_dir": self.model_dir,
            "dtype": self.cfg.dtype,
            "lora": self.lora,
            "critic": self.critic is not None,
            "temperature": self.temperature,
        }
        with self._span("checkpoint-save"):
            return checkpoint.save(path, self._parts(), rank_state, meta, self.model_dir)

    def _span(self, phase: str, start: float | None = None, **attrs: Any) -> Any:
        """A span of this rank's timeline lane (`furlong.core.spans`; the driver pulls them each step): a
        context manager, or with `start` the span from then to now, recorded at once."""
        lane, index = f"trainer/{self.rank}", self.device.index if self.device.index is not None else self.rank
        if start is not None:
            return spans.record(lane, phase, start, time.time(), device=f"{self.device.type}:{index}", **attrs)
        return spans.span(lane, phase, device=f"{self.device.type}:{index}", **attrs)

    def load(self, path: str | Path) -> None:
        """Restore the state `save` wrote; the trainer must be built with the same model and LoRA settings."""
        meta = checkpoint.read_meta(path)
        if meta.get("lora") != self.lora:
            raise ValueError(f"{path}/meta.json: lora={meta.get('lora')} but this trainer has train.lora={self.lora}")
        extra = checkpoint.load(path, self._parts())
        self.scheduler.load_state_dict(extra["scheduler"])
        if self.critic is not None:
            self.critic_scheduler.load_state_dict(extra["critic_scheduler"])
        self.step = int(extra["step"])
