"""LoRA adapters served at run time by the native forward: several resident at once, one per request.

What a served adapter computes: for a target linear y = x·Wᵀ, the request's tokens get
y + s·(x·Aᵀ)·Bᵀ with A [r, in], B [out, r] and s = alpha / r (alpha / √r with rsLoRA) —
PEFT's LoRA forward, so base + adapter here equals PEFT's model and equals the merged
W + s·B·A up to rounding. The base weights are never touched: adapters only add.

Where it runs: `NativeModel.proj` is the one seam every dense projection goes through.
Before each forward, `begin` turns the batch's per-request adapter names into row groups
of the flat batch (`Batch.lora`); `add` then adds each group's delta to the rows that use
it. A fused key ("3.qkv", "3.gate_up") holds several HF modules side by side: an adapter's
A matrices are stacked, its B matrices placed block-diagonally (scale folded in), so one
adapter costs two thin matmuls per key whatever it targets inside the key.

Two ways in:
- `/load_lora_adapter` (SGLang's endpoint): a PEFT directory, by name; requests pick it with
  `lora_path` (SGLang's field; it holds the adapter's name).
- weight sync (`train.lora.sync=adapter`): the trainer sends only A, B and a config tensor per
  adapter, named `lora::<adapter>::...` (`core.api.lora_tensor_name`). An adapter that arrives by
  weight sync is the engine's *policy adapter*: it is what the trained policy is (base + adapter),
  so requests that name no adapter are served with it — exactly what a merged sync would have
  served, on every path (rollout, eval, OpenAI routes, agents) without any of them changing.

KV reuse: a request that names an adapter neither reads nor fills the prefix cache and shares no
prefill (`Request.reuse_prefix`), since its keys and values differ from the base's. Requests that
name none keep both: the prefix cache is flushed whenever the policy adapter changes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from furlong.core.api import lora_tensor_name, parse_lora_tensor_name
from furlong.engine.weight_update import WeightUpdateError

_PEFT_PREFIX = "base_model.model."


@dataclass
class Adapter:
    name: str
    source: str  # the directory it was loaded from, or "weight sync"
    scaling: float
    a: dict[str, torch.Tensor]  # HF module name -> A [r, in]
    b: dict[str, torch.Tensor]  # HF module name -> B [out, r]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Its tensors under their sync names (what `/get_weights_checksum` lists, so delta sync and verify work)."""
        out = {lora_tensor_name(self.name, "", "config"): torch.tensor([self.scaling, float(len(self.a))])}
        for m in self.a:
            out[lora_tensor_name(self.name, m, "lora_A")] = self.a[m]
            out[lora_tensor_name(self.name, m, "lora_B")] = self.b[m]
        return out


def lora_groups(seqs: list, seq_of: list[int], logit_rows: list[int]) -> list[tuple[str | None, list[int], list[int]]]:
    """(adapter name or None, its flat token rows, its positions among the logit rows) per adapter in the batch;
    [] when no request names one. Host lists, built with the batch: the forward never reads them back."""
    if all(r.lora is None for r in seqs):
        return []
    groups: dict[str | None, tuple[list[int], list[int]]] = {}
    for i, s in enumerate(seq_of):
        groups.setdefault(seqs[s].lora, ([], []))[0].append(i)
    for j, i in enumerate(logit_rows):
        groups[seqs[seq_of[i]].lora][1].append(j)
    return [(name, rows, logits) for name, (rows, logits) in groups.items()]


class Adapters:
    """The adapters one `NativeModel` serves, and this forward's plan (which rows use which adapter)."""

    def __init__(self, model: Any):
        self.model = model
        self.loaded: dict[str, Adapter] = {}
        self.policy: str | None = None  # the adapter that arrived by weight sync; serves requests naming none
        self.plan: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] | None = None
        self._keys: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}  # adapter -> proj key -> (A, sB)
        self._slots: dict[str, tuple[str, int, int, int]] | None = None
        self._staged: dict[str, dict[str, torch.Tensor]] = {}  # weight sync: an adapter's tensors until complete

    # ------------------------------------------------------------------ where adapters can go
    def slots(self) -> dict[str, tuple[str, int, int, int]]:
        """HF module name -> (projection key, first output row in the key, last + 1, in-features)."""
        if self._slots is None:
            names: dict[int, str] = {}
            for name, m in self.model.hf.named_modules():
                if isinstance(m, torch.nn.Linear):
                    names.setdefault(id(m.weight), name)
            self._slots = {}
            for key, (_, deps) in self.model.sources.items():
                start = 0
                for p in deps:
                    if id(p) in names:
                        self._slots[names[id(p)]] = (key, start, start + p.shape[0], p.shape[1])
                    start += p.shape[0]
        return self._slots

    def _check(self, name: str, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], where: str) -> None:
        slots = self.slots()
        if not a or set(a) != set(b):
            missing = sorted(set(a) ^ set(b)) or ["(no modules)"]
            raise WeightUpdateError(f"{where}: adapter {name!r} lacks lora_A or lora_B for {missing[0]}")
        for m in a:
            if m not in slots:
                raise WeightUpdateError(
                    f"{where}: adapter {name!r} targets {m!r}, which is not a dense projection of the native "
                    f"forward (adaptable: q/k/v/o, gate/up/down of dense MLPs, lm_head)"
                )
            _, lo, hi, fan_in = slots[m]
            r = a[m].shape[0]
            if a[m].dim() != 2 or tuple(a[m].shape) != (r, fan_in) or tuple(b[m].shape) != (hi - lo, r):
                raise WeightUpdateError(
                    f"{where}: adapter {name!r} module {m!r}: lora_A {list(a[m].shape)} / lora_B {list(b[m].shape)} "
                    f"do not fit a [{hi - lo}, {fan_in}] weight"
                )

    def _install(self, ad: Adapter) -> None:
        like = self.model.k_pool[0]
        ad.a = {m: t.detach().to(like.device, like.dtype).contiguous() for m, t in ad.a.items()}
        ad.b = {m: t.detach().to(like.device, like.dtype).contiguous() for m, t in ad.b.items()}
        slots = self.slots()
        by_key: dict[str, list[str]] = {}
        for m in ad.a:
            by_key.setdefault(slots[m][0], []).append(m)
        packed = {}
        for key, mods in by_key.items():
            width = self.model.sources[key][0].shape[0]
            A = torch.cat([ad.a[m] for m in mods])  # [R, in]
            B = torch.zeros(width, A.shape[0], dtype=A.dtype, device=A.device)  # block-diagonal, scale folded in
            col = 0
            for m in mods:
                _, lo, hi, _ = slots[m]
                r = ad.a[m].shape[0]
                B[lo:hi, col : col + r] = ad.b[m] * ad.scaling
                col += r
            packed[key] = (A, B)
        self.loaded[ad.name] = ad
        self._keys[ad.name] = packed

    # ------------------------------------------------------------------ load / unload (scheduler thread)
    def load_dir(self, name: str, path: str | Path) -> Adapter:
        """Read a PEFT adapter directory (off the scheduler thread); `install` it afterwards."""
        from safetensors.torch import load_file

        p = Path(path)
        cfg_file, st = p / "adapter_config.json", p / "adapter_model.safetensors"
        if not (cfg_file.exists() and st.exists()):
            raise WeightUpdateError(f"lora_path: {str(p)!r} holds no adapter_config.json + adapter_model.safetensors")
        cfg = json.loads(cfg_file.read_text())
        unsupported = [
            k
            for k, bad in (
                ("use_dora", cfg.get("use_dora")),
                ("bias", cfg.get("bias", "none") != "none"),
                ("modules_to_save", cfg.get("modules_to_save")),
                ("fan_in_fan_out", cfg.get("fan_in_fan_out")),
                ("rank_pattern", cfg.get("rank_pattern")),
                ("alpha_pattern", cfg.get("alpha_pattern")),
            )
            if bad
        ]
        if unsupported:
            raise WeightUpdateError(f"lora_path: {cfg_file}: {unsupported[0]} is not served (plain LoRA only)")
        r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        a, b = {}, {}
        for key, t in load_file(str(st)).items():
            key = key.removeprefix(_PEFT_PREFIX)
            for part, into in ((".lora_A.", a), (".lora_B.", b)):
                if part in key:
                    into[key.split(part)[0]] = t
        self._check(name, a, b, "lora_path")
        return Adapter(name, str(p), scaling, a, b)

    def install(self, ad: Adapter) -> None:
        if ad.name in self.loaded:
            raise WeightUpdateError(f"lora_name: adapter {ad.name!r} is already loaded; unload it first")
        self._install(ad)

    def unload(self, name: str) -> None:
        if name not in self.loaded:
            raise WeightUpdateError(f"lora_name: no adapter {name!r} loaded (loaded: {sorted(self.loaded)})")
        del self.loaded[name], self._keys[name]
        if self.policy == name:
            self.policy = None

    def listing(self) -> dict[str, str]:
        return {n: ad.source for n, ad in self.loaded.items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: t for ad in self.loaded.values() for k, t in ad.tensors().items()}

    # ------------------------------------------------------------------ weight sync (scheduler thread)
    def receive(self, named: dict[str, torch.Tensor]) -> list[str]:
        """Stage synced adapter tensors; every adapter whose set is complete replaces its old self (and becomes
        the policy adapter). Returns the names installed. A bad name or shape raises before anything changes.

        A synced adapter already served is updated in part: what arrives replaces those tensors, the rest stay
        (a delta sync skips unchanged tensors; a bucketed sync lands in turn, as the base weights do)."""
        staged = {k: dict(v) for k, v in self._staged.items()}
        for n, t in named.items():
            adapter, _, _ = parse_lora_tensor_name(n)
            if adapter not in staged:  # a synced adapter updates in part (delta sync sends only what changed)
                old = self.loaded.get(adapter)
                staged[adapter] = old.tensors() if old is not None and old.source == "weight sync" else {}
            staged[adapter][n] = t.detach().clone()  # a transport's buffer (shm view) outlives no request
        ready = []
        for adapter, got in staged.items():
            cfg = got.get(lora_tensor_name(adapter, "", "config"))
            if cfg is None:
                continue
            a, b = {}, {}
            for n, t in got.items():
                _, m, part = parse_lora_tensor_name(n)
                if part in ("lora_A", "lora_B"):
                    (a if part == "lora_A" else b)[m] = t
                elif part != "config":
                    raise WeightUpdateError(f"tensor {n!r}: unknown adapter tensor (lora_A, lora_B or config)")
            if len(a) == len(b) == int(cfg[1]):
                self._check(adapter, a, b, f"tensor {lora_tensor_name(adapter, '', 'config')!r}")
                ready.append(Adapter(adapter, "weight sync", float(cfg[0]), a, b))
        for ad in ready:
            del staged[ad.name]
            self._install(ad)
            self.policy = ad.name
        self._staged = staged
        return [ad.name for ad in ready]

    # ------------------------------------------------------------------ the forward
    def begin(self, b) -> None:
        """This forward's plan: (adapter, flat rows, logit rows) per adapter in use, the rows None when it
        serves the whole batch. Built from host lists (no device sync); the index tensors go over non-blocking."""
        groups = [(self.policy if n is None else n, rows, at) for n, rows, at in b.lora]
        if not b.lora:
            groups = [(self.policy, None, None)]
        groups = [g for g in groups if g[0] is not None]
        if not groups:
            self.plan = None
        elif len(groups) == 1 and (groups[0][1] is None or len(groups[0][1]) == len(b.input_ids)):
            self.plan = [(groups[0][0], None, None)]  # one adapter for the whole batch: no row gathers
        else:
            dev = b.input_ids.device
            self.plan = [
                (
                    n,
                    torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True),
                    torch.tensor(at, dtype=torch.long).to(dev, non_blocking=True),
                )
                for n, rows, at in groups
            ]

    def add(self, key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each planned adapter's s·(x·Aᵀ)·Bᵀ on the rows that use it."""
        for name, rows, logit_rows in self.plan:
            ab = self._keys[name].get(key)
            if ab is None:
                continue
            A, B = ab
            idx = logit_rows if key == "lm_head" else rows
            if idx is None:
                y = y.addmm(x @ A.T, B.T)
            elif len(idx):
                y = y.index_add(0, idx, (x[idx] @ A.T) @ B.T)
        return y


def apply_weights(engine: Any, named: dict[str, torch.Tensor], version: int | None) -> int:
    """A weight-update request on the scheduler thread: model parameters as `Engine.apply_weights` does, adapter
    tensors (`lora::...`) into the model's adapters. Both are checked before either changes."""
    ours = {n: t for n, t in named.items() if parse_lora_tensor_name(n) is not None}
    if not ours:
        return engine.apply_weights(named, version)
    adapters = getattr(engine.model, "adapters", None)
    if adapters is None:
        raise WeightUpdateError(
            f"tensor {next(iter(ours))!r}: the {engine.backend} backend serves no LoRA adapters; "
            "use the native backend or set train.lora.sync=merged"
        )
    rest = {n: t for n, t in named.items() if n not in ours}
    if rest:
        from furlong.engine.weight_update import check_named_tensors

        check_named_tensors(engine.hf, rest)
    if adapters.receive(ours) and not rest:
        engine.pool.flush()  # cached prefixes were computed under the old policy adapter
    if rest:
        return engine.apply_weights(rest, version)
    engine.weight_version = int(version) if version is not None else engine.weight_version + 1
    engine.stats["weight_updates_total"] += 1
    return engine.weight_version
