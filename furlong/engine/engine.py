"""The engine: a continuous-batching scheduler running in one background thread.

Every step the scheduler (1) runs queued commands (abort, pause, weight update
…) so they land *between* forwards — that is what makes a weight update atomic
with respect to generation — (2) gives each running sequence a KV slot for its
next token, preempting the youngest sequences when the pool is full (they go
back to the queue and are recomputed later), (3) admits waiting requests while
slots and blocks allow — those with the same prompt as one admitted in the same step
share its prefill (`batching.fork`) — (4) runs one flat forward over all of them and
(5) samples, stamps each new token with the current weight version and
finishes sequences on eos / stop / length. Requests join and leave at every step.

Other threads talk to it only through `call(fn)` (a queue of closures with
futures) and `submit(req)`, so no engine state is ever touched concurrently.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from furlong.core import omp, profiling, spans
from furlong.core.api import PAUSE_MODES
from furlong.data.chat import stop_token_ids
from furlong.engine import graphs
from furlong.engine.batching import build_batch, can_lead, fork, tail_copies
from furlong.engine.device import resolve_device, run_forward
from furlong.engine.kv_cache import BlockPool
from furlong.engine.model import Batch, build_model
from furlong.engine.request import Request, admission_order, result
from furlong.engine.sampler import sample
from furlong.models.loading import check_model_dir, load_tokenizer

log = logging.getLogger("furlong.engine")


def context_window(model_positions: int, max_context: int | None) -> int:
    """The per-request token window: the model's positions, or a smaller `engine.max_context`.

    Larger is refused rather than clamped: positions past the model's never saw training, and a
    setting that silently does less than it says is the bug this check exists to prevent.
    """
    if max_context is None:
        return model_positions
    if max_context < 1:
        raise ValueError(f"engine.max_context (--max-context): must be >= 1, got {max_context}")
    if max_context > model_positions:
        raise ValueError(
            f"engine.max_context (--max-context): {max_context} exceeds the model's "
            f"{model_positions} max positions (max_position_embeddings)"
        )
    return max_context


class Engine:
    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        kv_cache_mb: int = 256,
        max_running: int = 64,
        block_size: int = 16,
        backend: str = "auto",
        max_prefill_tokens: int = 4096,
        max_context: int | None = None,
        prefix_cache: bool = True,
        device: str = "auto",
        quantization: str = "none",
        cuda_graphs: bool = False,
        compile_decode: bool = False,
    ):
        """`max_context` caps prompt + output tokens per request (None: the model's max positions; it can
        only shrink the window the model was trained for). `prefix_cache=False` computes every prompt in full.
        `device`: `engine.device` (auto | cpu | cuda[:N], see `engine.device`); weights and KV pool live there.
        `quantization`: `engine.quantization` (none | fp8 | mxfp8 | nvfp4 | int4, `engine/quantized.py`).
        `cuda_graphs`: `engine.cuda_graphs`, replay decode steps as CUDA graphs (`engine/graphs.py`; CUDA only).
        `compile_decode`: `engine.compile`, run decode and mixed steps compiled (`compiled_step.py`, `mixed_step.py`)."""
        from transformers import AutoModelForCausalLM

        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype: unknown dtype {dtype!r}; choose float32, bfloat16 or float16")
        if max_running < 1:
            raise ValueError("--max-running: must be >= 1")
        self.model_path = str(model_path)
        self.dtype = dtype
        self.device = resolve_device(device)  # before loading: a missing GPU fails here, naming engine.device
        graphs.require_cuda(cuda_graphs, self.device)
        # Checked first, so a missing config, shard or tokenizer file is named (not a hub lookup error).
        self.tokenizer = load_tokenizer(check_model_dir(self.model_path))
        self.hf = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, dtype)).eval()
        self.hf.to(self.device)
        self.hf.requires_grad_(False)
        cfg = self.hf.config
        self.vocab_size = cfg.vocab_size
        self.max_context = context_window(int(getattr(cfg, "max_position_embeddings", 2048)), max_context)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        bytes_per_token = (
            2
            * cfg.num_hidden_layers
            * cfg.num_key_value_heads
            * head_dim
            * torch.finfo(getattr(torch, dtype)).bits
            // 8
        )
        num_blocks = int(kv_cache_mb * 2**20 // (bytes_per_token * block_size))
        self.pool = BlockPool(num_blocks, block_size, prefix_cache=prefix_cache)
        with self.device:  # the KV pool is allocated where the weights are
            self.model = build_model(self.hf, num_blocks, block_size, backend, quantization)
        self.backend = type(self.model).__name__
        eos = self.hf.generation_config.eos_token_id if self.hf.generation_config else None
        eos = eos if eos is not None else cfg.eos_token_id
        # The generation config's EOS ids plus the chat template's end of turn (a config may list only EOS).
        self.eos_ids = set(stop_token_ids(self.tokenizer, eos))
        self.max_running = max_running
        self.graphs = graphs.for_engine(self, cuda_graphs, compile_decode)  # None unless either is on
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.paused: str | None = None
        self.threads = torch.get_num_threads()  # what the steps compute with (`set_threads`)
        self.stats = {
            "requests_total": 0,
            "finished_total": 0,
            "aborted_total": 0,
            "prompt_tokens_total": 0,
            "generation_tokens_total": 0,
            "preemptions_total": 0,
            "steps_total": 0,
            "weight_updates_total": 0,
            "prefills_total": 0,  # prompts computed (a forked sample of one is not)
            "forked_prefills_total": 0,  # samples that shared another request's prefill
            "low_priority_requests_total": 0,  # requests with priority < 0 (held-out eval: rollout.eval_mode)
        }
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._serial = 0  # numbers requests, so the model can tell its decoding set did not change
        self._stop = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ public API (any thread)
    @property
    def kv_capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.pool.block_size

    def start(self) -> Engine:
        """Run the scheduler on its own thread. The calling thread built the model: its OpenMP pool is freed
        here, else libgomp throttles the scheduler's (`core/omp.py`: 1.7x slower decode in bf16)."""
        profiling.on_sigterm(self.stop)  # under `furlong profile`: the scheduler thread writes its trace first
        omp.release()
        self._thread = threading.Thread(target=self._loop, name="furlong-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self._commands.put((lambda: None, Future()))
        if self._thread:
            self._thread.join(timeout=30)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the scheduler thread between two steps; its result lands in the future."""
        fut: Future = Future()
        self._commands.put((fn, fut))
        return fut

    def submit(self, req: Request) -> Request:
        self.call(lambda: self._add(req))
        return req

    def submit_many(self, reqs: list[Request]) -> list[Request]:
        """Submit in one command: all of `reqs` arrive in the same step, so those with the same prompt share
        one prefill (`sampling_params.n`, a GRPO group)."""
        self.call(lambda: [self._add(r) for r in reqs])
        return reqs

    def generate(self, reqs: list[Request], timeout: float | None = None) -> list[Request]:
        """Blocking helper for in-process use (tests, benchmark); submitted as one (`submit_many`)."""
        self.submit_many(reqs)
        for r in reqs:
            if not r.done.wait(timeout):
                raise TimeoutError(f"request {r.rid} did not finish in {timeout} s")
        return reqs

    def abort(self, rid: str | None = None) -> Future:
        return self.call(lambda: self._abort(rid))

    def pause(self, mode: str = "abort") -> Future:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: unknown pause mode {mode!r}; choose one of {list(PAUSE_MODES)}")
        return self.call(lambda: self._pause(mode))

    def resume(self) -> Future:
        return self.call(self._resume)

    def set_threads(self, n: int) -> Future:
        """Compute with `n` CPU threads from the next step on: set on the scheduler thread, whose ops they run."""

        def apply() -> int:
            torch.set_num_threads(n)
            self.threads = torch.get_num_threads()  # read on this thread: the count its ops use
            return self.threads

        return self.call(apply)

    def flush_cache(self) -> Future:
        return self.call(self.pool.flush)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def result(self, req: Request) -> dict[str, Any]:
        text = self.decode(req.output_ids, req.params.skip_special_tokens)
        if req.matched_stop is not None and not req.params.no_stop_trim:
            text = text[: text.find(req.matched_stop)] if req.matched_stop in text else text
        return result(req, text, self.weight_version)

    # ------------------------------------------------------------------ scheduler thread
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        profiling.start("engine")  # only under `furlong profile` (FURLONG_PROFILE_DIR): this thread's ops
        try:
            self._serve()
        finally:
            profiling.stop()

    def _serve(self) -> None:
        while not self._stop:
            idle = self.paused is not None or not (self.running or self.waiting)
            try:
                fn, fut = self._commands.get(timeout=0.5) if idle else self._commands.get_nowait()
            except queue.Empty:
                fn = None
            if fn is not None:
                self._run_command(fn, fut)
                while True:  # drain whatever else is queued before the next forward
                    try:
                        fn, fut = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    self._run_command(fn, fut)
            if self.paused is None and (self.running or self.waiting) and not self._stop:
                try:
                    self._step()
                except Exception as e:  # a broken step must not kill the server: fail its requests
                    log.exception("engine step failed")
                    for r in list(self.running) + list(self.waiting):
                        self._finish(r, {"type": "abort", "message": f"engine error: {e}"})

    def _run_command(self, fn: Callable[[], Any], fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return  # the caller gave up (e.g. its HTTP request was cancelled): do not run it half-watched
        try:
            fut.set_result(fn())
        except Exception as e:  # reported to the caller, never kills the loop
            fut.set_exception(e)

    def _add(self, req: Request) -> None:
        self.stats["requests_total"] += 1
        self.stats["prompt_tokens_total"] += len(req.prompt_ids)
        req.generator = req.params.generator()
        self._serial += 1
        req.serial = self._serial
        req.arrival_step = self.stats["steps_total"]
        self.stats["low_priority_requests_total"] += req.priority < 0
        if req.params.max_new_tokens == 0:
            self._finish(req, {"type": "length", "length": 0})
            return
        self.waiting.append(req)

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        if req.finished:
            return
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._drop_kv(req)
        self.stats["aborted_total" if reason["type"] == "abort" else "finished_total"] += 1
        req.done.set()
        if req.listener:
            req.listener(req, 0, True)

    def _drop_kv(self, req: Request) -> None:
        """Give back `req`'s KV blocks; its partial tail block stays cached for a request that continues it."""
        if req.reuse_prefix and self.pool.may_name(req.epoch):
            self.pool.keep_tail(req.blocks, req.hashes, req.tokens, req.n_cached, req.epoch)
        self.pool.release(req.blocks)
        req.blocks, req.hashes, req.n_cached = [], [], 0

    def _abort(self, rid: str | None) -> int:
        victims = [r for r in list(self.running) + list(self.waiting) if rid is None or r.rid == rid]
        for r in victims:
            self._finish(r, {"type": "abort", "message": "aborted by request"})
        return len(victims)

    def _retract(self, req: Request) -> None:
        """Free a running sequence's KV and put it back at the head of the queue (recompute later)."""
        self.running.remove(req)
        self._drop_kv(req)
        self.waiting.appendleft(req)

    def _pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort(None)
        elif mode == "retract":
            for r in reversed(list(self.running)):
                self._retract(r)
        self.paused = mode
        self._paused_at = time.time()

    def _resume(self) -> None:
        if self.paused is not None:  # the paused time as one span of this engine's lane
            spans.record("engine", "paused", getattr(self, "_paused_at", time.time()), time.time(), mode=self.paused)
        self.paused = None

    def _grow(self, req: Request, n_tokens: int) -> bool:
        """Make sure `req` owns blocks for `n_tokens` token slots."""
        need = -(-n_tokens // self.pool.block_size) - len(req.blocks)
        if need > self.pool.available:
            return False
        for _ in range(need):
            req.blocks.append(self.pool.alloc())
        return True

    def _schedule(self) -> tuple[list[Request], list[Request]]:
        decode = list(self.running)
        i = 0
        while i < len(decode):
            r = decode[i]
            if self._grow(r, r.n_cached + 1):
                i += 1
                continue
            victim = decode.pop()  # youngest; may be r itself
            self._retract(victim)
            self.stats["preemptions_total"] += 1
        admission_order(self.waiting, self.stats["steps_total"])  # request priority, with aging
        prefill, budget = [], self.max_prefill_tokens
        leaders: dict[tuple[int, ...], Request] = {}  # prompt -> the request prefilling it this step
        while self.waiting and len(decode) + len(prefill) < self.max_running:
            r = self.waiting[0]
            lead = leaders.get(tuple(r.prompt_ids)) if can_lead(r) and not r.blocks else None
            if lead is not None:  # same prompt as one prefilled this step: share its KV, no prefill of its own
                if not fork(self.pool, r, lead):
                    break
                self.waiting.popleft()
                prefill.append(r)
                continue
            toks = r.tokens
            if r.reuse_prefix and not r.blocks:
                r.blocks, r.hashes, r.n_cached, r.epoch = self.pool.match(toks)
                if not r.output_ids:
                    r.cached_prompt_tokens = r.n_cached
            new = len(toks) - r.n_cached
            if (prefill and new > budget) or not self._grow(r, len(toks)):
                if not decode and not prefill and not self.running:
                    # Nothing else holds memory: the request can never fit.
                    self.waiting.popleft()
                    self._finish(
                        r,
                        {
                            "type": "abort",
                            "message": f"needs {len(toks)} KV slots; cache holds {self.kv_capacity_tokens}",
                        },
                    )
                    continue
                self._drop_kv(r)
                break
            self.waiting.popleft()
            prefill.append(r)
            budget -= new
            if can_lead(r):
                leaders.setdefault(tuple(r.prompt_ids), r)
        return decode, prefill

    def _step(self) -> None:
        t0, preempted = time.time(), self.stats["preemptions_total"]
        decode, prefill = self._schedule()
        if not decode and not prefill:
            return
        batch, last_rows, prompt_rows = build_batch(
            decode, prefill, self.pool.block_size, getattr(self.model, "needs_tokens", False)
        )
        logits, routes = run_forward(self.model, batch, self.device, self.graphs)  # engine/device.py
        self.stats["steps_total"] += 1
        src, dst = tail_copies(prefill, self.pool.block_size)
        if src and hasattr(self.model, "copy_blocks"):
            with self.device:
                self.model.copy_blocks(src, dst)  # each fork's partial prompt block, before anything writes it
        forks = sum(r.fork_of is not None for r in prefill)
        self.stats["prefills_total"] += len(prefill) - forks
        self.stats["forked_prefills_total"] += forks
        for r in prefill:
            r.fork_of = None
        seqs = decode + prefill
        chosen = logits[torch.tensor(last_rows)]
        tokens, logprobs = sample(chosen, [r.params for r in seqs], [r.generator for r in seqs])
        want_lp = [i for i, r in enumerate(seqs) if r.return_logprob]
        tok_lp = logprobs[torch.arange(len(seqs)), torch.tensor(tokens)].tolist() if want_lp else [0.0] * len(seqs)
        if routes is not None:
            self._record_routes(seqs, batch, routes)
        for j, r in enumerate(prefill):  # prompt log-probs (teacher scoring), once per request
            first, n = prompt_rows[j]
            if first >= 0:
                lp = torch.log_softmax(logits[first : first + n - 1], dim=-1)
                nxt = torch.tensor(r.prompt_ids[1:])
                r.input_logprobs = [None] + lp.gather(1, nxt[:, None])[:, 0].tolist()
        now = time.time()
        for i, r in enumerate(seqs):
            r.n_cached = len(r.prompt_ids) + len(r.output_ids)
            full = r.n_cached // self.pool.block_size > len(r.hashes)
            if full and r.reuse_prefix and self.pool.may_name(r.epoch):
                self.pool.register(r.blocks, r.hashes, r.tokens, r.n_cached, r.epoch)
            r.output_ids.append(tokens[i])
            r.output_logprobs.append(tok_lp[i])
            r.output_versions.append(self.weight_version)
            if r.top_logprobs_num:
                v, ix = logprobs[i].topk(r.top_logprobs_num)
                r.output_top_logprobs.append(list(zip(v.tolist(), ix.tolist())))
            r.first_token_time = r.first_token_time or now
        self.stats["generation_tokens_total"] += len(seqs)
        self.running.extend(prefill)
        for r in seqs:
            reason = self._check_stop(r)
            if reason:
                self._finish(r, reason)
            elif r.listener and r.stream:
                r.listener(r, 1, False)
        if not self.running and hasattr(self.model, "release"):
            self.model.release()  # the decode view's memory goes back as soon as nothing decodes
        self._record_step(t0, batch, len(seqs), self.stats["preemptions_total"] - preempted)

    def _record_step(self, t0: float, batch: Batch, n_seqs: int, preempted: int) -> None:
        """One scheduler step on the timeline: kind, batch, tokens forwarded, KV use, preemptions; contiguous
        steps of one kind fold into one span (`merge`), so a lane stays a few spans per rollout, not one per token."""
        tokens = int(batch.input_ids.numel())
        spans.record(
            "engine",
            "prefill" if batch.prefills else "decode",
            t0,
            time.time(),
            merge=True,
            batch=n_seqs,
            tokens=tokens,
            steps=1,
            preempted=preempted,
            kv_usage=round(self.pool.used / max(1, self.pool.num_blocks), 4),
            version=self.weight_version,
        )

    def _record_routes(self, seqs: list[Request], batch: Batch, routes: torch.Tensor) -> None:
        for row, s in enumerate(batch.token_seq):
            r = seqs[s]
            if r.return_routed_experts:
                r.routes[int(batch.positions[row])] = routes[row].tolist()

    def _check_stop(self, r: Request) -> dict[str, Any] | None:
        t, p = r.output_ids[-1], r.params
        if not p.ignore_eos and t in self.eos_ids:
            return {"type": "stop", "matched": t}
        if t in p.stop_token_ids:
            return {"type": "stop", "matched": t}
        if p.stop:
            tail = self.decode(r.output_ids[-32:], p.skip_special_tokens)
            for s in p.stop:
                if s in tail:
                    r.matched_stop = s
                    return {"type": "stop", "matched": s}
        if len(r.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": len(r.output_ids)}
        if len(r.tokens) >= self.max_context:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    # ------------------------------------------------------------------ weights (scheduler thread)
    def apply_weights(self, named: dict[str, torch.Tensor], version: int | None = None) -> int:
        """Validate all, then copy all: a bad name or shape raises before any parameter changes."""
        from furlong.engine.weight_update import apply_named_tensors

        t0 = time.time()
        apply_named_tensors(self.hf, named, getattr(self.model, "quant", None))
        if hasattr(self.model, "refresh"):
            self.model.refresh(named.keys(), defer=version is None)  # packed once per sync: its stamped last bucket
        new, in_place = int(version) if version is not None else self.weight_version + 1, self.paused == "in_place"
        if not in_place or new != self.weight_version:  # in place (nothing runs between buckets): at the last one
            self.pool.flush(carry=in_place)  # cached KV no longer matches the weights (kept one update in place)
        self.weight_version = new
        self.stats["weight_updates_total"] += 1
        spans.record("engine", "weight-apply", t0, time.time(), tensors=len(named), version=self.weight_version)
        return self.weight_version
