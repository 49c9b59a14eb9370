"""Train-vs-rollout log-prob gap per rollout weight format, and what INT4 QAT does to it.

The rollout side is emulated in this process: each step the trainer's synced weights
(`Trainer.state_dict_for_sync`) are loaded into an HF copy of the model, whose linears are then
quantised with `furlong.weights.quant.quantize` (every nn.Linear bar lm_head, as `quantize_model_linears`
swaps in `QuantLinear`, whose forward is F.linear with the dequantised weight: the benchmark decodes
each weight once and holds it dense, the same matmul) or the model is cast to bf16. That model
samples the responses (`generate`, temperature 1) and scores them (one teacher-forced forward, fp32
log-softmax): those are the rollout log-probs an engine with that format would report. The furlong
engine does not take `engine.quantization` yet, hence the emulation.

The trainer (fp32, `train.qat=none` or `int4`) then takes a GRPO step on those samples, and the gap is
what its loss hub logs for that step, from the training forward's log-probs against the rollout's:
`mismatch/logprob_abs_diff` (mean over response tokens of |log pi_train - log pi_rollout|) and
`mismatch/kl` (the k3 estimate of KL(pi_rollout || pi_train)). Printed: the mean over `--steps` steps.

The model is the locally built qwen3 `--size` (random init), first given `--warmup` steps of
next-token training on a fixed synthetic rule (t_{i+1} = 5 t_i + 3 mod 500, a quarter of the
tokens replaced by random ones) so that its distributions are peaked but not one-hot, as a trained
model's are (a random-init model is near uniform, and every format's gap would look small). The
reward is the fraction of response tokens that follow the rule. Each arm starts from the same
warmed-up weights and draws the same prompts.

    python benchmarks/precision_mismatch.py [--size small] [--steps 3] [--prompts 8] [--samples 4]
                                            [--new-tokens 24] [--warmup 100] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

RULE_MOD, RULE_A, RULE_B, VOCAB_LOW = 500, 5, 3, 4  # token ids 4.. are ordinary tokens in the tiny vocab
NOISE = 0.25  # warm-up data: a quarter of the next tokens are random, so the model keeps some entropy
ARMS = (  # (rollout format, train.qat)
    ("fp32", "none"),
    ("bf16", "none"),
    ("fp8", "none"),
    ("mxfp8", "none"),
    ("nvfp4", "none"),
    ("int4", "none"),
    ("int4", "int4"),
)


def rule_next(t: torch.Tensor) -> torch.Tensor:
    return (RULE_A * (t - VOCAB_LOW) + RULE_B) % RULE_MOD + VOCAB_LOW


def rule_sequences(n: int, length: int, gen: torch.Generator, noise: float = 0.0) -> torch.Tensor:
    """Sequences following the rule, each next token replaced by a uniformly random one with prob. `noise`."""
    seq = [torch.randint(VOCAB_LOW, VOCAB_LOW + RULE_MOD, (n,), generator=gen)]
    for _ in range(length - 1):
        rand = torch.randint(VOCAB_LOW, VOCAB_LOW + RULE_MOD, (n,), generator=gen)
        seq.append(torch.where(torch.rand(n, generator=gen) < noise, rand, rule_next(seq[-1])))
    return torch.stack(seq, dim=1)


def warm_up(model_dir: Path, out: Path, steps: int, lr: float = 3e-3) -> float:
    """Next-token training on the rule, saved as an HF model directory; returns the final loss."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    loss = float("nan")
    for _ in range(steps):
        ids = rule_sequences(16, 24, gen, noise=NOISE)
        out_loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        out_loss.backward()
        opt.step()
        loss = float(out_loss.detach())
    model.save_pretrained(out)
    return loss


@torch.no_grad()
def rollout_model(skeleton, synced: dict[str, torch.Tensor], fmt: str):
    """An engine-like copy of the policy with the synced weights, its linears (bar lm_head) in `fmt`.

    `QuantLinear`'s forward is F.linear with `qweight.dequantize()`: each weight is decoded once here.
    """
    from furlong.weights.quant import quantize

    model = copy.deepcopy(skeleton)
    model.load_state_dict(synced)
    if fmt == "bf16":
        return model.to(torch.bfloat16).eval()
    if fmt != "fp32":
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head":
                m.weight.copy_(quantize(m.weight, fmt, name=name).dequantize())
    return model.eval()


@torch.no_grad()
def roll_out(model, prompts: torch.Tensor, samples: int, new_tokens: int, seed: int) -> list:
    """Sample `samples` responses per prompt with `model`, scored by it; one group per prompt."""
    from furlong.core.sample import Sample

    ids = prompts.repeat_interleave(samples, dim=0)
    torch.manual_seed(seed)
    full = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # every response is `new_tokens` long: no padding to account for
        pad_token_id=0,
    )
    p = ids.shape[1]
    logp = torch.log_softmax(model(full).logits[:, p - 1 : -1].float(), dim=-1)
    resp = full[:, p:]
    lps = logp.gather(-1, resp[..., None]).squeeze(-1)
    out = []
    for i in range(full.shape[0]):
        follows = (resp[i, 1:] == rule_next(resp[i, :-1])).float().mean()
        s = Sample(index=i, group_index=i // samples, tokens=ids[i].tolist(), reward=float(follows))
        s.append(resp[i].tolist(), logprobs=lps[i].tolist())
        out.append(s)
    return out


def run_arm(warm: Path, fmt: str, qat: str, args: argparse.Namespace) -> dict[str, float]:
    """`args.steps` rollout + train steps; the mean of the loss hub's mismatch metrics over them."""
    from transformers import AutoModelForCausalLM

    from furlong.config.schema import AlgoConfig, TrainConfig
    from furlong.train.trainer import Trainer

    trainer = Trainer(warm, TrainConfig(lr=args.lr, qat=qat, micro_batch_tokens=1024), AlgoConfig())
    skeleton = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for step in range(args.steps):
        engine = rollout_model(skeleton, dict(trainer.state_dict_for_sync()), fmt)
        prompts = rule_sequences(args.prompts, 6, gen)
        batch = roll_out(engine, prompts, args.samples, args.new_tokens, seed=100 + step)
        m = trainer.train_rollout(batch)["metrics"][0]
        rows.append((m["mismatch/logprob_abs_diff"], m["mismatch/kl"], statistics.mean(s.reward for s in batch)))
    abs_diff, kl, reward = (statistics.mean(col) for col in zip(*rows))
    return {"abs_diff": abs_diff, "kl": kl, "reward": reward}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=["tiny", "small", "m25"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from furlong.models import create_model

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        warm = Path(tmp) / "warm"
        loss = warm_up(create_model("qwen3", args.size), warm, args.warmup)
        print(f"qwen3 {args.size}: warm-up {args.warmup} steps, final next-token loss {loss:.3f}")
        print(f"{args.steps} steps x {args.prompts} prompts x {args.samples} samples x {args.new_tokens} tokens")
        print(f"{'rollout':<8} {'train.qat':<10} {'mean |dlogp|':>13} {'k3 KL':>10} {'reward':>7}")
        for fmt, qat in ARMS:
            r = run_arm(warm, fmt, qat, args)
            print(f"{fmt:<8} {qat:<10} {r['abs_diff']:>13.2e} {r['kl']:>10.2e} {r['reward']:>7.3f}", flush=True)
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
