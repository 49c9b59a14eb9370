"""R3: replay the engine's MoE routing in the trainer's forward.

A mixture-of-experts layer sends each token to its top-k experts. The engine and the trainer compute
the router's logits with different kernels (and often dtypes), so near-ties flip: a token the engine
sent to experts {1, 3} goes to {1, 2} in training, its log-prob jumps, and the importance ratio that
should be ≈ 1 on-policy is not. Rollout Routing Replay (R3; Ma et al., 2025, "Stabilizing MoE
Reinforcement Learning by Aligning Training and Inference Routers") records the engine's choice per
token (`Sample.routed_experts`, asked for by `rollout.routing_replay=true`) and makes the trainer use
it: *which* experts a token visits comes from the rollout.

*How much* each expert counts is still the trainer's own: the gate weights are the trainer's softmax
over all experts, gathered at the replayed ids and renormalised over the k when the router does
(`norm_topk_prob`; Mixtral always). So the router keeps its gradient, and with identical numerics
replay changes nothing at all.

The replay is a forward hook on each MoE block's router (HF's `*TopKRouter`, whose output is
`(logits, top-k weights, top-k ids)`), installed for one forward (`replayed`). Routes arrive aligned
with the packed block (`pack_routes`: one row per position, -1 where nothing was recorded, e.g. each
sample's last token, which the engine never forwarded and whose logits the loss never reads); such
positions keep the trainer's own choice. While it replays, the hook also counts how often the
trainer's own top-k (on the same hidden states) would have differed: `step_metrics` logs it per
step, measured in the training forward (the one with gradients).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from furlong.core.sample import ROUTE_DTYPES, Sample, SampleError, decode_routes
from furlong.train import compiled, dist

# Per model: [token-layer pairs replayed, of them differing, tokens replayed, of them differing in any layer].
_COUNTS: weakref.WeakKeyDictionary[nn.Module, Tensor] = weakref.WeakKeyDictionary()


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of the model's MoE blocks, in layer order (the order the engine records them in)."""
    return [m.gate for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts") and _is_router(m.gate)]


def _is_router(gate: Any) -> bool:
    return isinstance(gate, nn.Module) and hasattr(gate, "top_k") and hasattr(gate, "weight")


def decode(sample: Sample) -> Tensor:
    """`sample.routed_experts` as a `[positions, layers, k]` long tensor, -1 where none was recorded."""
    (n, layers, k), flat = decode_routes(sample.routed_experts, f"sample {sample.index}: routed_experts")
    ids = torch.tensor(flat, dtype=torch.long).view(n, layers, k)
    return ids.masked_fill_(ids == ROUTE_DTYPES[sample.routed_experts["dtype"]][1], -1)


def pack_routes(samples: list[Sample], width: int) -> Tensor | None:
    """The recorded routes of a micro-batch laid out as `batch.pack` lays out its tokens: sample i's position t
    is row `i * width + t` of the flattened `[B, width]` block (the router sees `[B * width, hidden]`).

    Returns `[B * width, layers, k]` long, -1 where nothing was recorded (padding, each sample's last token,
    a sample without routes); None when no sample has routes.
    """
    routes = [decode(s) if s.routed_experts is not None else None for s in samples]
    shapes = {tuple(r.shape[1:]) for r in routes if r is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise SampleError(f"routed_experts: samples of one batch disagree on [layers, k]: {sorted(shapes)}")
    layers, k = shapes.pop()
    out = torch.full((len(samples), width, layers, k), -1, dtype=torch.long)
    for i, r in enumerate(routes):
        if r is not None:
            out[i, : r.shape[0]] = r
    return out.view(len(samples) * width, layers, k)


def replayed(model: nn.Module, routes: Tensor | None) -> Callable[..., Any]:
    """`model`, or a callable that runs it once with `routes` (`pack_routes`) replayed in its MoE blocks."""
    if routes is None:
        return model
    routers = moe_routers(model)
    if len(routers) != routes.shape[1]:
        raise ValueError(
            f"rollout.routing_replay: the samples carry routes for {routes.shape[1]} MoE layers but the trainer's "
            f"model has {len(routers)} (a model without experts, or not the model the engines serve)"
        )
    if compiled.is_compiled(model):  # a compiled layer would not run the hooks below
        raise ValueError("rollout.routing_replay=true does not combine with train.compile (set train.compile=off)")
    if _checkpointing(model):
        # The backward recomputes each block after this forward has returned, with the hooks gone.
        raise ValueError("rollout.routing_replay=true does not combine with train.gradient_checkpointing=true")

    def run(*args: Any, **kwargs: Any) -> Any:
        counts = torch.zeros(4, dtype=torch.long, device=routes.device)
        differs: list[Tensor] = []  # per layer: which replayed positions the trainer would route elsewhere
        hooks = [r.register_forward_hook(_override(r, routes[:, i], counts, differs)) for i, r in enumerate(routers)]
        try:
            out = model(*args, **kwargs)
        finally:
            for h in hooks:
                h.remove()
        if torch.is_grad_enabled() and differs:
            any_layer = torch.stack(differs).any(0)
            counts[2] += int((routes >= 0).all(-1).any(-1).sum())
            counts[3] += int(any_layer.sum())
            _COUNTS[model] = _COUNTS.get(model, torch.zeros(4, dtype=torch.long)) + counts.cpu()
        return out

    return run


def _override(router: nn.Module, recorded: Tensor, counts: Tensor, differs: list[Tensor]) -> Callable:
    """A forward hook returning the router's output with the recorded ids and re-gathered gate weights."""
    norm = getattr(router, "norm_topk_prob", True)  # Mixtral's router always renormalises (no such attribute)

    def hook(_module: nn.Module, _inputs: Any, output: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        logits, weights, own = output
        if own.shape != recorded.shape:
            raise ValueError(
                f"routing replay: the router saw {tuple(own.shape)} [tokens, k] but {tuple(recorded.shape)} "
                "routes were recorded (the forward must take the block batch.pack builds)"
            )
        rec = recorded.to(own.device)
        valid = (rec >= 0).all(-1)
        ids = torch.where(valid[:, None], rec, own)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        gate = probs.gather(-1, ids)
        if norm:
            gate = gate / gate.sum(-1, keepdim=True)
        if torch.is_grad_enabled():
            differ = (own.sort(-1).values != rec.sort(-1).values).any(-1) & valid
            counts[0] += valid.sum().to(counts.device)
            counts[1] += differ.sum().to(counts.device)
            differs.append(differ)
        return logits, gate.to(weights.dtype), ids

    return hook


def step_metrics(model: nn.Module) -> dict[str, float]:
    """`r3/route_mismatch` (token-layer pairs) and `r3/token_mismatch` (tokens, any layer) since the last call.

    The fraction of replayed routes the trainer's own router would have chosen differently, summed over
    ranks; a collective where the model has MoE blocks, so every rank calls it (the trainer does, each
    optimiser step). Empty when nothing was replayed.
    """
    if not moe_routers(model):
        return {}
    counts = dist.all_reduce_sum(_COUNTS.pop(model, torch.zeros(4, dtype=torch.long)).to(_device(model))).cpu()
    pairs, pairs_differ, tokens, tokens_differ = counts.tolist()
    if not pairs:
        return {}
    return {"r3/route_mismatch": pairs_differ / pairs, "r3/token_mismatch": tokens_differ / max(tokens, 1)}


def _device(model: nn.Module) -> torch.device:
    """Where a collective on this model's process group runs (gloo: CPU, NCCL: the model's GPU)."""
    return next(model.parameters()).device


def _checkpointing(model: nn.Module) -> bool:
    """HF's activation-checkpointing flag (`is_gradient_checkpointing` before transformers 5.2x renamed it)."""
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if flag is None else flag)
