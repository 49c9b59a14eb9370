"""The engine's forward passes: a native batched path and a generic HF fallback.

Why a native path: HF `generate` pads every batch to one length and keeps one
cache per batch, so sequences cannot join or leave between steps. The native
path runs one *flat* forward over every token scheduled this step — one new
token per decoding sequence plus the prompt tokens of sequences being
prefilled — with linear layers on a `[tokens, hidden]` matrix and attention
reading a paged KV pool. It reads the parameters of the HF module itself, so
the checkpoint's parameter names are the engine's parameter names and a weight
update by HF name needs no mapping.

Why a fallback: any other causal LM still serves (slowly) by re-running the
HF forward over the whole padded sequences each step; no KV pool is used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from furlong.core import onednn
from furlong.engine import compiled_step
from furlong.engine.adapters import Adapters
from furlong.engine.attention import decode_attention, decode_mask, pick_decode_attention, prefill_attention, row_slots
from furlong.engine.decode_rows import DecodeRows
from furlong.engine.moe import moe, pick_experts
from furlong.engine.packed import Packed, Rows, placeholder
from furlong.engine.quantized import QuantizedWeights, QuantProj

if TYPE_CHECKING:
    from furlong.engine.batching import CachedPlan, PrefillPlan
    from furlong.engine.decode_rows import DecodePlan

NATIVE_ARCHS = {"qwen2", "qwen3", "llama", "mistral", "qwen3_moe", "mixtral"}
DYNAMIC_ROPE = {"dynamic", "longrope"}  # rotary scaling kinds whose frequencies follow the batch's longest position
MOE_ARCHS = {"qwen3_moe", "mixtral"}  # top-k routed experts stored as [E, 2*ffn, hidden] / [E, hidden, ffn]


def native_gap(cfg) -> str | None:
    """Why the native path cannot run this config exactly (None: it can).

    The native forward expresses pre-norm RMSNorm decoders with SiLU-gated MLPs (or
    top-k routed experts), full causal attention and full-width RoPE. A model with
    sliding-window layers, another activation or partial rotary would be served
    wrong, not slowly, so such configs go to the HF fallback instead.
    """
    arch = cfg.model_type
    if arch not in NATIVE_ARCHS:
        return f"architecture {arch!r} has no native path (native: {sorted(NATIVE_ARCHS)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act={cfg.hidden_act!r} (native: silu)"
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) and window is not None and window < cfg.max_position_embeddings:
        return f"sliding_window={window} is shorter than max_position_embeddings={cfg.max_position_embeddings}"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return "some layers are not full attention (layer_types)"
    if getattr(cfg, "partial_rotary_factor", 1.0) != 1.0:
        return f"partial_rotary_factor={cfg.partial_rotary_factor} (native: full-width RoPE)"
    return None


@dataclass
class Prefill:
    """One sequence's prompt chunk inside the flat batch."""

    start: int  # first index of its tokens in the flat batch
    n: int  # tokens in the chunk
    cached: int  # tokens already in the KV pool before this chunk (reused prefix)
    ctx_slots: torch.Tensor  # [cached + n] pool slots of the whole context
    key: int = -1  # its request's serial: the row a mixed step gives it stays its decode row (`mixed_step`)


@dataclass
class Batch:
    """Everything one forward needs; built by the scheduler each step.

    The first `n_decode` tokens are decode tokens (one per sequence), the rest
    are prefill chunks. `logit_rows` picks the flat positions whose logits are
    wanted (each sequence's last token, plus every prompt token of a sequence
    that asked for prompt log-probs).
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T]
    n_decode: int
    decode_blocks: torch.Tensor | None  # [D, nb] block table of each decoding sequence, padded with 0
    decode_lens: torch.Tensor | None  # [D] context length of each decoding sequence, its new token included
    prefills: list[Prefill]
    logit_rows: torch.Tensor
    decode_keys: tuple[int, ...] = ()  # a serial per decoding sequence: lets the model keep its KV view across steps
    token_seq: list[int] = field(default_factory=list)  # flat index -> index into `seq_tokens`
    seq_tokens: list[list[int]] = field(default_factory=list)  # full ids per sequence (fallback only)
    want_routes: bool = False
    # Host-side metadata (Python ints, built by the scheduler): the forward reads lengths from these, never from
    # a device tensor, so it never waits for the device (`engine/device.py`).
    decode_lens_host: list[int] = field(default_factory=list)  # = decode_lens
    prefill_plan: PrefillPlan | None = None  # fresh prompt chunks padded into one attention call (`batching`)
    cached_plan: CachedPlan | None = None  # chunks after a cached prefix, likewise, over the pool (`batching`)
    decode_plan: DecodePlan | None = None  # decode rows of this step, set by `NativeModel.prepare` on the host
    lora: list[tuple[str | None, list[int], list[int]]] = field(default_factory=list)  # adapters.lora_groups


class NativeModel:
    """Flat batched forward for Qwen2/3, Llama, Mistral, Qwen3-MoE and Mixtral over a paged KV pool."""

    def __init__(self, hf_model, num_blocks: int, block_size: int, quantization: str = "none"):
        """`quantization` (`engine.quantization`): none, or the format the dense projections are held in
        (codes + scales, `furlong/engine/quantized.py`); lm_head, embeddings, norms and MoE experts stay dense."""
        cfg = hf_model.config
        self.hf = hf_model
        self.cfg = cfg
        self.arch = cfg.model_type
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.layers = list(hf_model.model.layers)
        dtype, device = next(hf_model.parameters()).dtype, next(hf_model.parameters()).device
        # Block-major pool: gathering whole blocks copies block_size * kv * hd contiguous floats per row.
        shape = (num_blocks, block_size, self.n_kv, self.head_dim)
        self.block_size = block_size
        self.k_pool = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]  # on the weights' device
        self.v_pool = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.is_moe = self.arch in MOE_ARCHS
        self.rope_table = self._rope_table(num_blocks * block_size)
        self.attend_rows = pick_decode_attention(dtype, device, self.n_kv, self.n_heads // self.n_kv, self.head_dim)
        # oneDNN packing is a CPU kernel; on a GPU the forward multiplies by the HF weights themselves.
        self.linear, self._pack = onednn.pick_linear(dtype) if self.k_pool[0].is_cpu else (F.linear, lambda w: w)
        # Before the keys are built: quantised projections are held as codes + scales, never fused or packed.
        self.quant = QuantizedWeights(hf_model, quantization) if quantization != "none" else None
        # Dense weights by key ("3.qkv", "lm_head", ...): (source tensor, the HF parameters it reads).
        self.sources: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.bias: dict[str, torch.Tensor | None] = {}  # by key: the HF bias the projection adds (None: none)
        # What the forward multiplies by: packed (oneDNN) or the source itself; a QuantProj when quantised.
        self.w: dict[str, torch.Tensor | QuantProj] = {}
        for li, layer in enumerate(self.layers):
            at, mlp = layer.self_attn, layer.mlp
            self._add_group(li, "qkv", (("q", at.q_proj), ("k", at.k_proj), ("v", at.v_proj)))
            self._add(f"{li}.o", at.o_proj)
            if hasattr(mlp, "gate_proj"):
                self._add_group(li, "gate_up", (("gate", mlp.gate_proj), ("up", mlp.up_proj)))
                self._add(f"{li}.down", mlp.down_proj)
        self._add("lm_head", hf_model.lm_head)
        if self.quant is not None:
            self.quant.check_all_used()
        self.packed: dict[str, Packed] = {}  # keys whose packed weight is written in place (engine/packed.py)
        self.held: set[str] = set()  # of those, the keys whose HF parameters are meta placeholders
        self.refresh()
        self._hold()
        self.decode_kv: DecodeRows | None = None
        self.adapters = Adapters(self)  # LoRA adapters served per request (engine/adapters.py)

    def _add(self, key: str, module, source: torch.Tensor | None = None, parts: list | None = None) -> None:
        quantised = self.quant.proj(module) if self.quant is not None else None
        if quantised is not None:
            self.w[key] = quantised  # updated in place by a sync: nothing to re-pack
        else:
            self.sources[key] = (module.weight if source is None else source, [m.weight for m in parts or [module]])
        self.bias[key] = getattr(module, "bias", None)

    def _add_group(self, li: int, fused_key: str, named: tuple) -> None:
        """Fuse bias-free projections that read the same input (q|k|v, gate|up) under one key; biased ones
        (Qwen2's qkv, Llama's mlp_bias) stay one key each ("3.q", "3.k", ...)."""
        modules = [m for _, m in named]
        quantised = self.quant is not None and any(self.quant.holds(m) for m in modules)
        fused = None if quantised else _fuse(*modules)  # quantised weights stay one per HF parameter
        if fused is not None:
            self._add(f"{li}.{fused_key}", modules[0], fused, modules)
        else:
            for name, m in named:
                self._add(f"{li}.{name}", m)

    def proj(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """Every dense projection of the forward, by key ("3.qkv", "3.o", "lm_head", ...).

        Why one method: it is the single place where what a linear computes can change — a weight
        stored in a low-precision format, or a per-request adapter added to the output — without
        touching the attention and MLP code around it."""
        if torch.compiler.is_compiling():  # engine.compile: an opaque op that runs this method when the graph runs
            return compiled_step.proj(self, key, x)
        w = self.w[key]  # a QuantProj under engine.quantization: codes + scales, dequantised per block
        y = self.linear(x, w, self.bias[key]) if isinstance(w, torch.Tensor) else w(x, self.bias[key])
        return self.adapters.add(key, x, y) if self.adapters.plan else y

    def refresh(self, names=None, defer: bool = False) -> None:
        """Re-pack the weights that read the named HF parameters (all when `names` is None), after an update.

        `defer`: only mark them; they are packed at the next non-deferred refresh or before the next
        forward, whichever comes first. Why: a sync arrives in buckets, and a fused weight (q|k|v) whose
        parts land in different buckets would otherwise be re-packed — a full copy — once per bucket."""
        if names is None:
            keys = list(self.sources)
        else:
            params = self.hf.state_dict(keep_vars=True)
            touched = {id(params[n]) for n in names if n in params}
            keys = [k for k, (_, deps) in self.sources.items() if any(id(d) in touched for d in deps)]
        keys = [k for k in keys if k not in self.held]  # written in place by the update itself
        self._dirty = getattr(self, "_dirty", set()) | set(keys)
        if not defer:
            self._repack()

    def _repack(self) -> None:
        for k in self._dirty:
            if k in self.packed:  # into the same memory: no allocation, and the forward's tensor stays the same
                self.packed[k].write(0, self.sources[k][0])
            else:
                self.w[k] = self._pack(self.sources[k][0])
        self._dirty = set()

    def _hold(self) -> None:
        """Write each oneDNN-packed weight in place from now on (`engine/packed.py`): where its layout is
        understood, and (held) its HF parameters become meta placeholders that name their packed rows, unless
        another module reads them too (an lm_head tied to the embeddings is still copied, then re-packed in
        place). Why: a sync is then one pass straight into the weights the forward reads, and the engine no
        longer keeps a second, plain copy of every projection."""
        if self._pack is not onednn.pack:
            return
        users: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        for mod in self.hf.modules():
            for pname, p in mod._parameters.items():
                if p is not None:
                    users.setdefault(id(p), []).append((mod, pname))
        for key, (src, deps) in list(self.sources.items()):
            pk = Packed.of(self.w[key], src, self._pack)
            if pk is None:
                continue
            self.packed[key] = pk
            if any(len(users.get(id(d), ())) != 1 for d in deps):
                continue  # read elsewhere (tied): keep the HF tensor, re-pack it in place after updates
            held, lo = [], 0
            for d in deps:
                mod, pname = users[id(d)][0]
                setattr(mod, pname, placeholder(d, Rows(pk, lo, lo + d.shape[0])))
                held.append(getattr(mod, pname))
                lo += d.shape[0]
            self.sources[key] = (torch.empty(src.shape, dtype=src.dtype, device="meta"), held)
            self.held.add(key)

    def release(self) -> None:
        """Drop the decode rows (the scheduler calls this when nothing is running). Under CUDA graphs
        (`keep_decode_rows`) keep their storage, which the captured graphs read in place, and forget
        only who sat where, so the next requests are gathered from the pool and no graph is recaptured."""
        if self.decode_kv is not None and getattr(self, "keep_decode_rows", False):
            self.decode_kv.row_of = {}
        else:
            self.decode_kv = None

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole KV blocks, every layer: a forked sample's partial prompt block from its leader's."""
        dev = self.k_pool[0].device  # non-blocking: a pageable host-to-device copy does not wait for the device
        s, d = torch.tensor(src).to(dev, non_blocking=True), torch.tensor(dst).to(dev, non_blocking=True)
        for kb, vb in zip(self.k_pool, self.v_pool):
            kb[d] = kb[s]
            vb[d] = vb[s]

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """HF's `x * cos + rotate_half(x) * sin`, each half computed from the halves of x, rotate_half's sign
        folded into sin. Why not one `roll`: a compiled step gathers a rolled vector one element at a time
        (the roll's index wraps inside the vector), which made the rotation the slowest part of its layer."""
        half = x.shape[-1] // 2
        lo, hi = x[..., :half], x[..., half:]
        return torch.cat(
            (lo * cos[..., :half] + hi * sin_signed[..., :half], hi * cos[..., half:] + lo * sin_signed[..., half:]),
            dim=-1,
        )

    @functools.cached_property
    def experts_kind(self) -> str:
        """How MoE blocks compute (`engine.moe.pick_experts`: grouped GEMM or dense), probed once."""
        return pick_experts(self.k_pool[0].dtype, self.k_pool[0].device)

    def prepare(self, b: Batch, with_prefills: bool = False) -> None:
        """On the host, before the batch moves to the device: assign this step's decode rows (`b.decode_plan`).
        `with_prefills`: rows for the prompt chunks too, after the decoding sequences (a mixed step that
        attends over rows, `mixed_step`); their rows then stay theirs when they decode.

        Why here and not in the forward: the row bookkeeping is Python state, and index tensors made
        from it inside the forward would be blocking host-to-device copies; made here they travel with
        the batch (`device.batch_to`, one non-blocking copy each)."""
        if self.is_moe:
            self.experts_kind  # noqa: B018 - the one-off probe runs here, not inside the first forward
        if not (b.n_decode or with_prefills):
            return
        dec, self.decode_kv = self.decode_kv, None  # set again only if this step completes
        if dec is None:
            pool = self.k_pool[0]
            dec = DecodeRows(len(self.layers), self.n_kv, self.head_dim, pool.dtype, pool.device)
        keys, lens, adds = b.decode_keys, b.decode_lens_host, None
        if with_prefills:
            keys += tuple(p.key for p in b.prefills)
            lens = lens + [p.cached + p.n for p in b.prefills]
            adds = [1] * b.n_decode + [p.n for p in b.prefills]
        b.decode_plan = dec.plan(keys, lens, adds)
        self.decode_kv = dec

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden [T, H], cos, signed sin [T, 1, hd]) of the tokens at `positions`."""
        x = self.hf.model.embed_tokens(ids)
        if self.rope_table is not None:
            cos, sin = self.rope_table
            return x, cos.index_select(0, positions), sin.index_select(0, positions)
        return (x, *self._rotary(positions, x.dtype))

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, hd] at `positions`, by the HF model's own rotary module (its scaling kind)."""
        probe = torch.empty(1, 1, self.head_dim, dtype=dtype, device=positions.device)  # only its dtype is read
        cos, sin = self.hf.model.rotary_emb(probe, positions[None])
        half = self.head_dim // 2
        return cos[0, :, None, :], torch.cat((-sin[0, :, None, :half], sin[0, :, None, half:]), dim=-1)

    def _rope_table(self, pool_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and signed sin [P, 1, hd] of every position a sequence can reach (the model's positions, at most
        the pool's tokens), computed once by the same rotary module; None where its frequencies depend on the
        batch's longest position (dynamic and longrope scaling), which a table fixed in advance cannot follow.

        Why: inside a compiled step Inductor inlines the pointwise cos(position x frequency) into every consumer,
        so each layer evaluated a cosine for every element of q and k; a table makes it a load (1.3% of a 32-row
        bf16 decode step, 2 threads, interleaved A/B; `benchmarks/RESULTS.md`, round 23), and its values are the
        ones the rotary module computes for those positions."""
        kind = getattr(self.hf.model.rotary_emb, "rope_type", None)
        if not isinstance(kind, str) or kind in DYNAMIC_ROPE:
            return None
        P = min(int(getattr(self.cfg, "max_position_embeddings", pool_tokens)), pool_tokens)
        dtype, device = self.k_pool[0].dtype, self.k_pool[0].device
        return self._rotary(torch.arange(P, device=device), dtype)

    def _qkv(self, li: int, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `li`'s normed, projected, (q/k-normed) and rotated q [T, H, hd], k and v [T, kv, hd]."""
        layer, T, hd = self.layers[li], x.shape[0], self.head_dim
        at = layer.self_attn
        h = self._norm(x, layer.input_layernorm.weight)
        if f"{li}.qkv" in self.w:
            nq, nk = self.n_heads * hd, self.n_kv * hd
            q, k, v = self.proj(f"{li}.qkv", h).split([nq, nk, nk], dim=-1)
        else:
            q, k, v = (self.proj(f"{li}.{n}", h) for n in "qkv")
        q, k, v = q.reshape(T, self.n_heads, hd), k.reshape(T, self.n_kv, hd), v.reshape(T, self.n_kv, hd)
        if hasattr(at, "q_norm"):
            q = self._norm(q, at.q_norm.weight)
            k = self._norm(k, at.k_norm.weight)
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    def _mlp(self, li: int, x: torch.Tensor, routes: list | None) -> torch.Tensor:
        """x plus layer `li`'s MLP (or routed experts; their top-k ids appended to `routes` when given)."""
        layer = self.layers[li]
        h = self._norm(x, layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        if self.is_moe and hasattr(mlp, "gate") and hasattr(mlp, "experts"):
            if torch.compiler.is_compiling():  # engine.compile: routed experts as an opaque op (no routes recorded)
                return x + compiled_step.experts(self, li, h)
            y, top_i = moe(mlp, h, self.experts_kind)
            if routes is not None:
                routes.append(top_i)
            return x + y
        if f"{li}.gate_up" in self.w:
            gate, up = self.proj(f"{li}.gate_up", h).chunk(2, dim=-1)
        else:  # biased gate/up (Llama mlp_bias): not fused
            gate, up = self.proj(f"{li}.gate", h), self.proj(f"{li}.up", h)
        return x + self.proj(f"{li}.down", F.silu(gate) * up)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj("lm_head", self._norm(x, self.hf.model.norm.weight)).float()

    def write_kv(self, li: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Every token's k and v into the paged pool (the truth for prefix reuse and preemption)."""
        self.k_pool[li].view(-1, self.n_kv, self.head_dim).index_copy_(0, slots, k)
        self.v_pool[li].view(-1, self.n_kv, self.head_dim).index_copy_(0, slots, v)

    @torch.inference_mode()
    def forward(self, b: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (logits[len(logit_rows), V] in fp32, routes[T, layers, k] or None).

        Reads lengths only from the batch's host metadata: no `.item()`, `.tolist()` or data-dependent
        shape on the device (tests/unit/test_engine_host_sync.py), so on a GPU it never stalls."""
        if self._dirty:
            self._repack()  # a sync's last bucket had no version stamp: pack what it left marked
        self.adapters.begin(b)  # which rows use which LoRA adapter (engine/adapters.py)
        x, cos, sin = self._embed(b.input_ids, b.positions)
        T, D = x.shape[0], b.n_decode
        dec, self.decode_kv = self.decode_kv, None  # set again only if this forward completes
        if D:
            if b.decode_plan is None:
                raise ValueError("NativeModel.forward: a batch with decode tokens needs NativeModel.prepare(batch)")
            mask = decode_mask(b.decode_plan.row_lens, b.decode_plan.L, x.dtype)
            slots = row_slots(dec, b.decode_plan.rows, b.decode_lens - 1)
        routes: list | None = [] if b.want_routes else None
        for li in range(len(self.layers)):
            q, k, v = self._qkv(li, x, cos, sin)
            self.write_kv(li, b.write_slots, k, v)
            out = torch.empty_like(q)
            if D:
                out[:D] = decode_attention(self, li, q, k, v, b, dec, mask, slots)
            if b.prefills:
                prefill_attention(self, li, q, k, v, b, out)
            x = self._mlp(li, x + self.proj(f"{li}.o", out.reshape(T, -1)), routes)
        logits = self._head(x[b.logit_rows])
        if D:
            dec.commit(b.decode_plan.rows_list, b.decode_lens_host)
        self.decode_kv = dec
        return logits, (torch.stack(routes, dim=1) if routes else None)


def _fuse(*linears) -> torch.Tensor | None:
    """Concatenate bias-free linear weights into one matrix and make each HF parameter a view of it.

    One [T, H] x [H, sum(out)] matmul beats several narrow ones; because the HF
    parameters *are* slices of the fused matrix, a weight update that copies
    into them by HF name updates the fused matrix too — no refresh step.
    """
    if any(m.bias is not None for m in linears):
        return None
    fused = torch.cat([m.weight.data for m in linears]).contiguous()
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = fused[start : start + n]
        start += n
    return fused


class FallbackModel:
    """Any HF causal LM: re-run the whole (right-padded) sequences every step.

    Quadratic in length and slow, but exact and architecture-agnostic; the
    scheduler still does its block accounting, so budgets behave the same.
    """

    is_moe = False
    needs_tokens = True  # the scheduler fills Batch.seq_tokens only for this backend

    def __init__(self, hf_model):
        self.hf = hf_model

    @torch.inference_mode()
    def forward(self, b: Batch) -> tuple[torch.Tensor, None]:
        seqs = b.seq_tokens
        L = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), L, dtype=torch.long)
        att = torch.zeros(len(seqs), L, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            att[i, : len(s)] = 1
        logits = self.hf(input_ids=ids, attention_mask=att).logits
        rows = b.logit_rows.tolist()
        seq_of = [b.token_seq[r] for r in rows]
        pos = b.positions[b.logit_rows].tolist()
        return logits[seq_of, pos].float(), None


def build_model(hf_model, num_blocks: int, block_size: int, backend: str = "auto", quantization: str = "none"):
    """Pick the native path where `native_gap` finds nothing missing (or when forced), the fallback otherwise.

    `quantization` other than none needs the native path (the HF fallback would compute with dense weights)."""
    if backend not in ("auto", "native", "hf"):
        raise ValueError(f"--backend: unknown backend {backend!r}; choose auto, native or hf")
    gap = native_gap(hf_model.config)
    if quantization != "none" and (backend == "hf" or gap is not None):
        why = "--backend hf" if backend == "hf" else gap
        raise ValueError(f"engine.quantization={quantization}: needs the native forward, ruled out by {why}")
    if backend == "hf" or (backend == "auto" and gap is not None):
        return FallbackModel(hf_model)
    if gap is not None:
        raise ValueError(f"--backend native: {gap}; use --backend hf")
    return NativeModel(hf_model, num_blocks, block_size, quantization)
