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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

NATIVE_ARCHS = {"qwen3", "llama", "qwen3_moe"}


@dataclass
class Prefill:
    """One sequence's prompt chunk inside the flat batch."""

    start: int  # first index of its tokens in the flat batch
    n: int  # tokens in the chunk
    cached: int  # tokens already in the KV pool before this chunk (reused prefix)
    ctx_slots: torch.Tensor  # [cached + n] pool slots of the whole context


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
    decode_mask: torch.Tensor | None  # [D, 1, 1, nb * block_size] True = attend
    prefills: list[Prefill]
    logit_rows: torch.Tensor
    token_seq: list[int] = field(default_factory=list)  # flat index -> index into `seq_tokens`
    seq_tokens: list[list[int]] = field(default_factory=list)  # full ids per sequence (fallback only)
    want_routes: bool = False


class NativeModel:
    """Flat batched forward for Qwen3 / Llama / Qwen3-MoE over a paged KV pool."""

    def __init__(self, hf_model, num_blocks: int, block_size: int):
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
        dtype = next(hf_model.parameters()).dtype
        # Block-major pool: gathering whole blocks copies block_size * kv * hd contiguous floats per row.
        shape = (num_blocks, block_size, self.n_kv, self.head_dim)
        self.k_pool = [torch.zeros(shape, dtype=dtype) for _ in self.layers]
        self.v_pool = [torch.zeros(shape, dtype=dtype) for _ in self.layers]
        self.is_moe = self.arch == "qwen3_moe"
        self.qkv = [_fuse(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj) for l in self.layers]
        self.gate_up = [_fuse(l.mlp.gate_proj, l.mlp.up_proj) if hasattr(l.mlp, "gate_proj") else None for l in self.layers]

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def _moe(self, mlp, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routed experts, computed like HF's Qwen3MoeSparseMoeBlock; returns (out, topk ids)."""
        gate = mlp.gate
        probs = torch.softmax(F.linear(x, gate.weight), dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(probs, gate.top_k, dim=-1)
        if gate.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(x.dtype)
        experts = mlp.experts
        out = torch.zeros_like(x)
        for e in torch.unique(top_i).tolist():
            tok, k = torch.where(top_i == e)
            g, u = F.linear(x[tok], experts.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(g) * u, experts.down_proj[e]) * top_w[tok, k, None]
            out.index_add_(0, tok, h)
        return out, top_i

    @torch.inference_mode()
    def forward(self, b: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (logits[len(logit_rows), V] in fp32, routes[T, layers, k] or None)."""
        m = self.hf.model
        x = m.embed_tokens(b.input_ids)
        cos, sin = m.rotary_emb(x[None], b.positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [T, 1, hd]
        T = x.shape[0]
        D, g = b.n_decode, self.n_heads // self.n_kv
        routes = []
        for li, layer in enumerate(self.layers):
            at = layer.self_attn
            h = self._norm(x, layer.input_layernorm.weight)
            nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
            if self.qkv[li] is not None:
                q, k, v = F.linear(h, self.qkv[li]).split([nq, nk, nk], dim=-1)
            else:
                q, k, v = (F.linear(h, m.weight, m.bias) for m in (at.q_proj, at.k_proj, at.v_proj))
            q, k, v = q.reshape(T, self.n_heads, self.head_dim), k.reshape(T, self.n_kv, self.head_dim), v.reshape(T, self.n_kv, self.head_dim)
            if hasattr(at, "q_norm"):
                q = self._norm(q, at.q_norm.weight)
                k = self._norm(k, at.k_norm.weight)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            kb, vb = self.k_pool[li], self.v_pool[li]
            kp, vp = kb.view(-1, self.n_kv, self.head_dim), vb.view(-1, self.n_kv, self.head_dim)  # by token slot
            kp.index_copy_(0, b.write_slots, k)
            vp.index_copy_(0, b.write_slots, v)
            out = torch.empty_like(q)
            if D:
                # GQA decode as SDPA with the g query heads of a kv head in the "query length" slot.
                flat = b.decode_blocks.view(-1)  # index_select is several times faster than advanced indexing here
                kc = kb.index_select(0, flat).view(D, -1, self.n_kv, self.head_dim).transpose(1, 2)  # [D, kv, L, hd]
                vc = vb.index_select(0, flat).view(D, -1, self.n_kv, self.head_dim).transpose(1, 2)
                qd = q[:D].view(D, self.n_kv, g, self.head_dim)
                od = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=b.decode_mask, scale=self.scale)
                out[:D] = od.reshape(D, self.n_heads, self.head_dim)
            for p in b.prefills:
                qs = q[p.start : p.start + p.n].transpose(0, 1)[None]  # [1, H, n, hd]
                if p.cached == 0:
                    ks, vs = k[p.start : p.start + p.n], v[p.start : p.start + p.n]
                    mask, causal = None, True
                else:
                    ks, vs = kp.index_select(0, p.ctx_slots), vp.index_select(0, p.ctx_slots)
                    total = p.cached + p.n
                    mask = torch.arange(total)[None, :] <= (p.cached + torch.arange(p.n))[:, None]
                    causal = False
                ks = ks.transpose(0, 1).repeat_interleave(g, dim=0)[None]
                vs = vs.transpose(0, 1).repeat_interleave(g, dim=0)[None]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal, scale=self.scale)
                out[p.start : p.start + p.n] = o[0].transpose(0, 1)
            x = x + F.linear(out.reshape(T, -1), at.o_proj.weight, at.o_proj.bias)
            h = self._norm(x, layer.post_attention_layernorm.weight)
            mlp = layer.mlp
            if self.is_moe and hasattr(mlp, "gate") and hasattr(mlp, "experts"):
                y, top_i = self._moe(mlp, h)
                if b.want_routes:
                    routes.append(top_i)
                x = x + y
            elif self.gate_up[li] is not None:
                gate, up = F.linear(h, self.gate_up[li]).chunk(2, dim=-1)
                x = x + F.linear(F.silu(gate) * up, mlp.down_proj.weight)
            else:
                x = x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight), mlp.down_proj.weight)
        x = self._norm(x[b.logit_rows], m.norm.weight)
        logits = self.hf.lm_head(x).float()
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


def build_model(hf_model, num_blocks: int, block_size: int, backend: str = "auto"):
    """Pick the native path for known archs (or when forced), the fallback otherwise."""
    if backend not in ("auto", "native", "hf"):
        raise ValueError(f"--backend: unknown backend {backend!r}; choose auto, native or hf")
    arch = hf_model.config.model_type
    if backend == "hf" or (backend == "auto" and arch not in NATIVE_ARCHS):
        return FallbackModel(hf_model)
    if arch not in NATIVE_ARCHS:
        raise ValueError(f"--backend native: architecture {arch!r} has no native path; use --backend hf")
    return NativeModel(hf_model, num_blocks, block_size)
