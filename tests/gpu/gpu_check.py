"""The GPU check behind `scripts/gpu-check.sh`: correctness and speed figures of the GPU paths, written to a file.

Made for one H200 with PyTorch 2.11 + CUDA 13 and transformers 5.17, no Ray, no network;
every model is built here with random weights. Steps, each recorded with its figures:

1. greedy: the built-in engine (`engine.device=cuda`, bf16) against HF on the same prompts —
   greedy tokens equal, and the log-prob gap: HF's teacher-forced log-probs of the engine's
   own tokens minus the engine's reported ones. Stated tolerance in bf16: 0.1 nats (bf16 keeps
   8 mantissa bits; different but equally valid kernel orders move a log-prob by ~1e-2);
   fp32 (tiny mode): 1e-3 nats. A greedy divergence counts as a tie (and passes) when HF's margin of
   its own pick over the engine's token at that step is within the tolerance (random models have many).
2. throughput: engine tokens/s vs HF `generate` on a ~0.5B Qwen3-shaped model, batch 64,
   256 new tokens, equal-length prompts (target: engine >= 3x HF).
3. weight sync: GB/s of a full push of that model into a `furlong serve` process over CUDA
   IPC, and over NCCL broadcast when a second GPU exists (NCCL cannot put two ranks on one
   GPU), against the device-to-device copy bandwidth of the same bytes measured in this run
   (target: CUDA IPC >= 50% of it).
4. grpo: 5 GRPO steps, trainer in this process, engine in its own `furlong serve` process,
   weights pushed after every step (CUDA IPC on GPU, shm in tiny mode), each version checked
   on the engine.
5. cuda_graphs: decode tokens/s of the same model with `engine.cuda_graphs` on against the eager
   engine, at batch 64 and batch 8 (where launch overhead weighs most), 256 new tokens, and how
   many greedy outputs agree. Skipped in tiny mode (CUDA graphs need CUDA), with the reason recorded.

`--tiny` runs every step on CPU with the tiny model (seconds), so the script is known to
work before a GPU machine runs it; its speed figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
TOKEN = "gpu-check-admin-token"


@dataclass(frozen=True)
class Plan:
    device: str
    dtype: str
    batch: int
    new_tokens: int
    prompt_len: int
    grpo_model: str  # a factory size (the GRPO stage needs a tokenizer that covers the vocabulary)
    grpo_prompts: int
    grpo_samples: int
    grpo_new_tokens: int
    sync_transport: str
    lp_tolerance: float
    kv_cache_mb: int


FULL = Plan("cuda", "bfloat16", 64, 256, 64, "small", 8, 4, 32, "cuda_ipc", 0.1, 6144)
TINY = Plan("cpu", "float32", 4, 16, 12, "tiny", 2, 2, 8, "shm", 1e-3, 16)


def log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(plan: Plan) -> None:
    if plan.device == "cuda":
        torch.cuda.synchronize()


def build_model(plan: Plan, tiny: bool, out: Path) -> tuple[Path, int]:
    """(model dir, parameters): the tiny factory model, or a Qwen3-0.6B-shaped one with random weights."""
    from furlong.models import create_model

    if tiny:
        path = create_model("qwen3", "tiny")
        return path, json.loads((path / "furlong_model.json").read_text())["parameters"]
    from transformers import AutoModelForCausalLM

    from furlong.models.factory import Size, hf_config
    from furlong.models.tokenizer import build_tokenizer

    cfg = hf_config("qwen3", Size(hidden=1024, layers=24, heads=16, kv_heads=8, head_dim=128, ffn=3072, vocab=151936))
    cfg.tie_word_embeddings = True  # as Qwen3-0.6B: ~0.53B parameters
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    build_tokenizer(512, 0, "chatml").save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def prompts(n: int, length: int, seed: int, vary: bool = False) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    sizes = [max(2, length - (i * 7) % (length // 2)) if vary else length for i in range(n)]
    return [torch.randint(3, 500, (s,), generator=g).tolist() for s in sizes]


def step_greedy(plan: Plan, path: Path, engine, hf) -> dict:
    from furlong.engine.request import Request
    from furlong.engine.sampler import SamplingParams

    ps = prompts(8, plan.prompt_len, 1, vary=True)
    n = 32
    reqs = engine.generate([Request(p, SamplingParams(n, 0.0, ignore_eos=True), return_logprob=True) for p in ps], 600)
    equal, first_diff, tie_gaps, gap = 0, [], [], 0.0
    for p, r in zip(ps, reqs):
        ids = torch.tensor([p], device=plan.device)
        kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)[0, len(p) :].tolist()
        equal += want == r.output_ids
        diff = next((i for i, (a, b) in enumerate(zip(want, r.output_ids)) if a != b), None)
        first_diff.append(diff)
        with torch.no_grad():
            full = torch.tensor([p + r.output_ids], device=plan.device)
            lp = torch.log_softmax(hf(full).logits[0].float(), -1)
        ref = lp[len(p) - 1 : -1].gather(-1, torch.tensor(r.output_ids, device=plan.device)[:, None])[:, 0]
        gap = max(gap, (ref.cpu() - torch.tensor(r.output_logprobs)).abs().max().item())
        if diff is not None:  # same context up to here: HF's margin of its own pick over the engine's
            row = lp[len(p) - 1 + diff]
            tie_gaps.append((row.max() - row[r.output_ids[diff]]).item())
    return {
        "prompts": len(ps),
        "new_tokens": n,
        "greedy_equal": equal,
        "first_divergence": first_diff,
        "divergence_margins_nats": tie_gaps,  # a divergence is a tie when HF's margin is within the tolerance
        "max_logprob_gap_nats": gap,
        "tolerance_nats": plan.lp_tolerance,
        "ok": gap <= plan.lp_tolerance and all(m <= plan.lp_tolerance for m in tie_gaps),
    }


def step_throughput(plan: Plan, engine, hf) -> dict:
    from furlong.engine.request import Request
    from furlong.engine.sampler import SamplingParams

    ps = prompts(plan.batch, plan.prompt_len, 2)
    params = SamplingParams(plan.new_tokens, 0.0, ignore_eos=True)
    engine.generate([Request(p, SamplingParams(8, 0.0, ignore_eos=True)) for p in ps[:4]], 600)  # warm-up
    sync(plan)
    t0 = time.perf_counter()
    engine.generate([Request(p, params) for p in ps], 1200)
    sync(plan)
    t_engine = time.perf_counter() - t0
    ids = torch.tensor(ps, device=plan.device)
    with torch.no_grad():
        mask = torch.ones_like(ids)
        hf.generate(ids[:4], attention_mask=mask[:4], max_new_tokens=8, do_sample=False, pad_token_id=0)  # warm-up
        sync(plan)
        t0 = time.perf_counter()
        n = plan.new_tokens
        hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(plan)
    t_hf = time.perf_counter() - t0
    tokens = plan.batch * plan.new_tokens
    return {
        "batch": plan.batch,
        "new_tokens": plan.new_tokens,
        "prompt_len": plan.prompt_len,
        "engine_tok_s": tokens / t_engine,
        "hf_generate_tok_s": tokens / t_hf,
        "ratio": t_hf / t_engine,
        "target_ratio": 3.0,
    }


def step_cuda_graphs(plan: Plan, path: Path, eager) -> dict:
    """Tokens/s with `engine.cuda_graphs` against the eager engine `eager`, same prompts, greedy."""
    if plan.device != "cuda":
        return {"skipped": "engine.cuda_graphs captures CUDA graphs: no CUDA device in this mode (CPU)"}
    from furlong.engine.engine import Engine
    from furlong.engine.request import Request
    from furlong.engine.sampler import SamplingParams

    kw = dict(dtype=plan.dtype, device=plan.device, kv_cache_mb=plan.kv_cache_mb, max_running=plan.batch)
    graphed = Engine(path, cuda_graphs=True, **kw).start()
    out: dict = {}
    try:
        for batch in (plan.batch, 8):
            ps = prompts(batch, plan.prompt_len, 3)
            row: dict = {}
            for name, eng in (("eager", eager), ("graphs", graphed)):
                eng.generate([Request(p, SamplingParams(8, 0.0, ignore_eos=True)) for p in ps], 600)  # warm-up, capture
                sync(plan)
                t0 = time.perf_counter()
                reqs = eng.generate(
                    [Request(p, SamplingParams(plan.new_tokens, 0.0, ignore_eos=True)) for p in ps], 1200
                )
                sync(plan)
                row[f"{name}_tok_s"] = batch * plan.new_tokens / (time.perf_counter() - t0)
                row[f"{name}_outputs"] = [r.output_ids for r in reqs]
            a, b = row.pop("eager_outputs"), row.pop("graphs_outputs")
            row.update(speedup=row["graphs_tok_s"] / row["eager_tok_s"], greedy_equal=sum(x == y for x, y in zip(a, b)))
            out[f"batch_{batch}"] = row
        out["replays_by_bucket"] = {B: n for B, n in graphed.graphs.replays.items() if n}
    finally:
        graphed.stop()
    return out


def copy_bandwidth(plan: Plan, named: list[tuple[str, torch.Tensor]]) -> float:
    """GB/s of copying every tensor into one preallocated buffer on the same device (best of 3)."""
    total = sum(t.numel() * t.element_size() for _, t in named)
    buf = torch.empty(total, dtype=torch.uint8, device=plan.device)
    best = float("inf")
    for _ in range(3):
        sync(plan)
        t0, off = time.perf_counter(), 0
        for _, t in named:
            n = t.numel() * t.element_size()
            buf[off : off + n].copy_(t.reshape(-1).view(torch.uint8))
            off += n
        sync(plan)
        best = min(best, time.perf_counter() - t0)
    return total / best / 1e9


def serve(path: Path, plan: Plan, logs: Path, name: str, device: str | None = None):
    """A `furlong serve` process (the same command the cluster launcher runs), started and healthy."""
    from furlong.core.net import free_port
    from furlong.core.processes import Command, ManagedProcess, furlong_argv, token_env

    port = free_port()
    argv = furlong_argv("serve", "--model", str(path), "--port", str(port), "--dtype", plan.dtype)
    argv += ["--device", device or plan.device, "--kv-cache-mb", str(min(plan.kv_cache_mb, 1024))]
    proc = ManagedProcess(name, Command(argv, token_env(TOKEN)), f"http://127.0.0.1:{port}", str(logs / f"{name}.log"))
    return proc.start(600)


def push_rate(transport: str, url: str, named: list[tuple[str, torch.Tensor]], repeats: int = 3, **opts) -> dict:
    from furlong.weights.factory import make_sender

    sender = make_sender(transport, bucket_mb=512, **opts)
    sender.connect([url], TOKEN)
    try:
        first = sender.push(iter(named), 1)
        sender.verify = True
        verified = sender.push(iter(named), 2)
        sender.verify = False
        best = min(sender.push(iter(named), 3 + i).seconds for i in range(repeats))
    finally:
        sender.close()
    return {"bytes": first.bytes, "gb_s": first.bytes / best / 1e9, "verified": bool(verified.verified)}


def step_weight_sync(plan: Plan, path: Path, hf, logs: Path) -> dict:
    named = [(n, t.detach()) for n, t in hf.state_dict().items()]
    out: dict = {"copy_gb_s": copy_bandwidth(plan, named), "copy_kind": f"{plan.device} to {plan.device}"}
    proc = serve(path, plan, logs, "sync-engine")
    try:
        r = push_rate(plan.sync_transport, proc.url, named)
        out[plan.sync_transport] = {**r, "fraction_of_copy": r["gb_s"] / out["copy_gb_s"], "target_fraction": 0.5}
    finally:
        proc.stop()
    if plan.device == "cuda" and torch.cuda.device_count() < 2:
        out["nccl"] = {"skipped": "one GPU: NCCL cannot place the trainer and engine ranks on the same device"}
    else:
        proc = serve(path, plan, logs, "sync-engine-2", device="cuda:1" if plan.device == "cuda" else None)
        try:
            backend = "nccl" if plan.device == "cuda" else "gloo"
            out[f"broadcast_{backend}"] = push_rate("broadcast", proc.url, named, backend=backend)
        finally:
            proc.stop()
    return out


def step_grpo(plan: Plan, logs: Path, steps: int = 5) -> dict:
    """`steps` GRPO steps: trainer here, engine in its own process, weights pushed and checked after each."""
    from furlong.config.schema import AlgoConfig, TrainConfig
    from furlong.core.client import EngineClient, EngineControl
    from furlong.core.sample import Sample
    from furlong.models import create_model, load_tokenizer
    from furlong.rollout.generate import RolloutContext, derive_seed, generate
    from furlong.train.trainer import Trainer
    from furlong.weights.factory import make_sender

    path = create_model("qwen3", plan.grpo_model)
    n = plan.grpo_prompts * plan.grpo_samples
    trainer = Trainer(
        path,
        TrainConfig(lr=1e-4, global_batch_size=n, micro_batch_tokens=4096, dtype="float32"),
        AlgoConfig(),
        0,
        1,
        temperature=1.0,
    )
    proc = serve(path, plan, logs, "grpo-engine")
    sender = make_sender(plan.sync_transport, bucket_mb=256)
    sender.connect([proc.url], TOKEN)
    tok, records = load_tokenizer(path), []

    async def rollout(step: int) -> list[Sample]:
        client = EngineClient(proc.url, admin_token=TOKEN)
        ctx = RolloutContext(client, tok)
        batch = [
            Sample(index=i * plan.grpo_samples + j, group_index=i, tokens=list(p))
            for i, p in enumerate(prompts(plan.grpo_prompts, 8, 100 + step))
            for j in range(plan.grpo_samples)
        ]
        params = {"max_new_tokens": plan.grpo_new_tokens, "temperature": 1.0}
        done = await asyncio.gather(*[generate(ctx, s, {**params, "seed": derive_seed(step, s.index)}) for s in batch])
        await client.aclose()
        for s in done:  # a verifiable toy reward: the share of response tokens in the lower half of the vocabulary
            s.reward = sum(t < 256 for t in s.response_tokens) / max(1, s.response_length)
        return list(done)

    try:
        with EngineControl(proc.url, admin_token=TOKEN) as ctl:
            for step in range(steps):
                t0 = time.perf_counter()
                batch = asyncio.run(rollout(step))
                t1 = time.perf_counter()
                m = trainer.train_rollout(batch)["metrics"][-1]
                t2 = time.perf_counter()
                report = sender.push(trainer.state_dict_for_sync(), step + 1)
                on_engine = ctl.weight_version()
                records.append(
                    {
                        "step": step + 1,
                        "reward": sum(s.reward for s in batch) / len(batch),
                        "grad_norm": float(m.get("grad_norm", 0.0)),
                        "rollout_s": t1 - t0,
                        "train_s": t2 - t1,
                        "sync_s": report.seconds,
                        "engine_version": on_engine,
                    }
                )
                log(f"grpo step {step + 1}: {records[-1]}")
    finally:
        sender.close()
        proc.stop()
    ok = all(r["engine_version"] == r["step"] and r["grad_norm"] > 0 for r in records)
    return {
        "model": plan.grpo_model,
        "samples_per_step": n,
        "transport": plan.sync_transport,
        "steps": records,
        "ok": ok,
    }


def machine() -> dict:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    info["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


def run(tiny: bool, out: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from furlong.engine.engine import Engine

    plan = TINY if tiny else FULL
    if not tiny and not torch.cuda.is_available():
        raise SystemExit("gpu-check: no CUDA device visible; run with GPU_CHECK_TINY=1 for the CPU tiny mode")
    doc: dict = {"mode": "tiny (CPU: speed figures mean nothing)" if tiny else "full", "plan": asdict(plan)}
    doc["machine"], doc["steps"], t_start = machine(), {}, time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="furlong-gpu-check-"))
    logs = work / "logs"
    logs.mkdir()

    def record(name: str, fn, *args) -> None:
        t0 = time.perf_counter()
        log(f"{name} ...")
        try:
            doc["steps"][name] = {**fn(*args), "seconds": round(time.perf_counter() - t0, 2)}
        except Exception as e:  # noqa: BLE001 - one failed step must not hide the figures of the others
            doc["steps"][name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        log(f"{name}: {json.dumps(doc['steps'][name])[:600]}")
        out.write_text(json.dumps(doc, indent=1))

    path, n_params = build_model(plan, tiny, work / "model")
    doc["model"] = {"path": str(path), "parameters": n_params}
    engine = Engine(
        path, dtype=plan.dtype, device=plan.device, kv_cache_mb=plan.kv_cache_mb, max_running=plan.batch
    ).start()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, plan.dtype)).to(plan.device).eval()
    try:
        record("greedy", step_greedy, plan, path, engine, hf)
        record("throughput", step_throughput, plan, engine, hf)
        record("cuda_graphs", step_cuda_graphs, plan, path, engine)
    finally:
        engine.stop()
        del engine
    record("weight_sync", step_weight_sync, plan, path, hf, logs)
    del hf
    if plan.device == "cuda":
        torch.cuda.empty_cache()
    record("grpo", step_grpo, plan, logs)
    doc["seconds"] = round(time.perf_counter() - t_start, 1)
    doc["ok"] = all("error" not in s and s.get("ok", True) for s in doc["steps"].values())
    out.write_text(json.dumps(doc, indent=1))
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU, tiny model: checks the script, not the GPU")
    p.add_argument("--out", default="gpu-check.json", help="JSON file for the figures")
    args = p.parse_args(argv)
    doc = run(args.tiny, Path(args.out))
    log(f"wrote {args.out}: ok={doc['ok']} in {doc['seconds']} s")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
