"""One generation request as the scheduler tracks it, and the result dict it becomes.

The result follows SGLang's `/generate` shape (`text`, `output_ids`,
`meta_info` with `finish_reason`, token counts and `[logprob, token_id, null]`
log-prob triples) plus furlong's per-token `output_token_versions`, so rollout
code reads the built-in engine and SGLang alike.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from furlong.engine.sampler import SamplingParams


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    logprob_start_len: int = -1  # >= 0: also return prompt log-probs from this index (teacher scoring)
    top_logprobs_num: int = 0
    return_routed_experts: bool = False
    lora: str | None = None  # SGLang's `lora_path`: the adapter that serves it (None: the policy adapter, if any)
    stream: bool = False
    priority: int = 0  # SGLang's `priority`: larger is admitted first (see `admission_order`)
    # Called from the scheduler thread: (request, n_new_tokens, finished). Must not block.
    listener: Callable[[Request, int, bool], None] | None = None

    # ---- state owned by the scheduler thread ----
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    routes: dict[int, list[list[int]]] = field(default_factory=dict)  # position -> [layer][k]
    finish_reason: dict[str, Any] | None = None
    matched_stop: str | None = None
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    epoch: int = 0
    n_cached: int = 0  # tokens whose KV is in the pool
    serial: int = 0  # set by the engine on arrival
    arrival_step: int = 0  # the scheduler step it arrived at (priority aging)
    cached_prompt_tokens: int = 0
    fork_of: Request | None = None  # the leader whose prompt KV this request shares (one step only)
    generator: Any = None
    created: float = field(default_factory=time.time)
    first_token_time: float | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def reuse_prefix(self) -> bool:
        # Prompt log-probs and routed experts need every prompt position computed; a named adapter's KV is
        # its own (the prefix cache and prefill sharing hold KV of requests that name none).
        return self.logprob_start_len < 0 and not self.return_routed_experts and self.lora is None


AGING_STEPS = 32  # scheduler steps of waiting that raise a request's priority by one


def admission_order(waiting: deque[Request], step: int) -> None:
    """Order the queue for admission: larger effective priority first, queue order among equals.

    The rule: effective priority = `priority` + (scheduler steps waited) // `AGING_STEPS`. A request of
    priority p behind a stream of priority q > p requests reaches q after (q - p) * AGING_STEPS steps and
    then, being older than every newcomer of priority q, goes first among them: a lower priority waits
    longer, never forever. Admission only: running sequences are never preempted for priority. With one
    priority in the queue (the usual case) this is a no-op, so arrival order (and a retracted sequence's
    place at the head) is kept exactly.
    """
    if len({r.priority for r in waiting}) < 2:
        return
    ordered = sorted(waiting, key=lambda r: -(r.priority + (step - r.arrival_step) // AGING_STEPS))
    waiting.clear()
    waiting.extend(ordered)


def result(req: Request, text: str, weight_version: int) -> dict[str, Any]:
    """The SGLang-shaped `/generate` response of a finished request."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_prompt_tokens,
        "weight_version": req.output_versions[-1] if req.output_versions else weight_version,
        "output_token_versions": list(req.output_versions),
        "e2e_latency": time.time() - req.created,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.output_logprobs, req.output_ids)]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = [[[lp, t, None] for lp, t in top] for top in req.output_top_logprobs]
        if req.input_logprobs is not None:
            start = max(req.logprob_start_len, 0)
            meta["input_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(req.input_logprobs[start:], req.prompt_ids[start:])
            ]
    if req.return_routed_experts:
        n = len(req.prompt_ids) + len(req.output_ids) - 1
        meta["routed_experts"] = [req.routes.get(p) for p in range(n)]
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}
