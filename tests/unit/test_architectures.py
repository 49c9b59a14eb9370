"""Every model family end to end, on a tiny random-weight model built from the real transformers config class.

Per family (`furlong/models/families.py`), with a tokenizer carrying a chat template in the
family's style: the engine picks the expected path (native where `native_gap` finds nothing
missing, the HF fallback otherwise); engine greedy equals HF greedy; engine log-probs equal
the trainer's (1e-4, fp32); one GRPO step changes the weights; a weight sync over shared
memory and HTTP (verified by CRC) makes the engine's log-probs the trained policy's.
`tools/model_table.py` renders CHECKS (one comment below marks each) and the family list as the
table in docs/models.md; `test_docs_table_is_current` keeps that table in step with this list.
"""

from __future__ import annotations

import math

import pytest
import torch

from furlong.config.schema import AlgoConfig, TrainConfig
from furlong.core.sample import Sample
from furlong.data.chat import encode_prompt
from furlong.engine.engine import Engine
from furlong.engine.model import native_gap
from furlong.engine.request import Request
from furlong.engine.sampler import SamplingParams
from furlong.engine.server import ServerThread
from furlong.models import create_model, load_tokenizer
from furlong.models.families import CHECKS, FAMILIES
from furlong.train.trainer import Trainer
from furlong.weights import make_sender

torch.set_num_threads(1)
N = 6  # new tokens per request
CONVERSATIONS = [
    [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "user", "content": "Reverse the string abc."}],
]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Argmax decoding with the HF forward itself: no generate() logits processors, no stop on EOS."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def as_samples(prompts: list[list[int]], outs, rewards: list[float]) -> list[Sample]:
    samples = []
    for i, (p, r, reward) in enumerate(zip(prompts, outs, rewards)):
        s = Sample(index=i, group_index=0, tokens=list(p), reward=reward)
        s.append(r.output_ids, logprobs=r.output_logprobs)
        samples.append(s)
    return samples


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


@pytest.mark.timeout(480)
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_family_end_to_end(arch: str) -> None:
    from transformers import AutoModelForCausalLM

    fam = FAMILIES[arch]
    path = create_model(arch, "tiny", template=fam.style)
    tok = load_tokenizer(path)
    prompts = [encode_prompt(tok, c) for c in CONVERSATIONS]
    engine = Engine(path, kv_cache_mb=1, max_running=8, block_size=4).start()
    try:
        hf = AutoModelForCausalLM.from_pretrained(path).eval()
        # CHECKS[0] engine path: native exactly where the config has nothing the native forward lacks
        assert engine.backend == ("NativeModel" if native_gap(hf.config) is None else "FallbackModel")
        assert engine.model.is_moe == (fam.moe and engine.backend == "NativeModel")

        # CHECKS[1] greedy = HF
        greedy = SamplingParams(max_new_tokens=N, temperature=0, ignore_eos=True)
        outs = engine.generate([Request(p, greedy, return_logprob=True) for p in prompts], timeout=120)
        for p, r in zip(prompts, outs):
            assert r.output_ids == hf_greedy(hf, p, N), arch

        if engine.model.is_moe:  # the routed experts the engine reports are HF's router's choices
            (r,) = engine.generate([Request(prompts[0], greedy, return_routed_experts=True)], timeout=60)
            seen = []
            hooks = [
                layer.mlp.gate.register_forward_hook(lambda m, i, o: seen.append(o[2])) for layer in hf.model.layers
            ]
            with torch.no_grad():
                hf(torch.tensor([prompts[0] + r.output_ids[:-1]]))
            for h in hooks:
                h.remove()
            got = torch.tensor(engine.result(r)["meta_info"]["routed_experts"])
            assert torch.equal(got.sort(-1).values, torch.stack(seen, dim=1).sort(-1).values)

        # CHECKS[2] log-probs = trainer's
        trainer = Trainer(path, TrainConfig(lr=1e-2, micro_batch_tokens=256), AlgoConfig())
        batch = as_samples(prompts, outs, [0.0, 0.0])
        assert max_diff(trainer.compute_logprobs(batch), [r.output_logprobs for r in outs]) < 1e-4

        # CHECKS[3] one GRPO step over one group of four sampled answers with different rewards
        group = [prompts[0]] * 4
        sampled = engine.generate(
            [
                Request(
                    p, SamplingParams(max_new_tokens=N, temperature=1.0, seed=i, ignore_eos=True), return_logprob=True
                )
                for i, p in enumerate(group)
            ],
            timeout=120,
        )
        before = {k: v.clone() for k, v in trainer.state_dict_for_sync()}
        metrics = trainer.train_step(as_samples(group, sampled, [1.0, 0.0, 0.5, 0.0]))
        assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        after = dict(trainer.state_dict_for_sync())
        assert any(not torch.equal(before[k], after[k]) for k in before), "the GRPO step changed no weight"

        # CHECKS[4] weight sync through a real transport: shared memory + the engine's HTTP control API
        with ServerThread(engine, admin_token="T") as server, make_sender("shm", verify=True) as sender:
            sender.connect([server.url], "T")
            report = sender.push(trainer.state_dict_for_sync(), 1)
        assert report.ok and report.verified and engine.weight_version == 1
        again = engine.generate([Request(p, greedy, return_logprob=True) for p in prompts], timeout=120)
        trained = trainer.compute_logprobs(as_samples(prompts, again, [0.0, 0.0]))
        assert max_diff(trained, [r.output_logprobs for r in again]) < 1e-4
        assert max_diff(trained, [r.output_logprobs for r in outs]) > 1e-3 or any(
            a.output_ids != b.output_ids for a, b in zip(again, outs)
        ), "the sync did not change what the engine computes"
    finally:
        engine.stop()


def test_docs_table_is_current() -> None:
    """docs/models.md holds exactly the table `tools/model_table.py` renders from FAMILIES and CHECKS."""
    from tools.model_table import DOC, render_table, table_in

    assert CHECKS and len(FAMILIES) >= 8
    assert table_in(DOC.read_text(encoding="utf-8")) == render_table(), "run: python -m tools.model_table --write"


def test_native_gap_sends_what_the_native_forward_cannot_express_to_the_fallback() -> None:
    from transformers import AutoModelForCausalLM

    from furlong.engine.model import FallbackModel, build_model
    from furlong.models.factory import SIZES, hf_config

    tiny = SIZES["tiny"]
    windowed = hf_config("mistral", tiny)
    windowed.sliding_window = 64  # Mistral v0.1: a window shorter than the context
    gelu = hf_config("llama", tiny)
    gelu.hidden_act = "gelu"
    assert "sliding_window=64" in native_gap(windowed)
    assert "hidden_act='gelu'" in native_gap(gelu)
    assert "'gemma2' has no native path" in native_gap(hf_config("gemma2", tiny))
    assert all(native_gap(hf_config(a, tiny)) is None for a in ("qwen2", "mistral", "mixtral"))
    model = AutoModelForCausalLM.from_config(windowed)
    assert isinstance(build_model(model, 8, 4, "auto"), FallbackModel)
    with pytest.raises(ValueError, match="--backend native: sliding_window=64 .*use --backend hf"):
        build_model(model, 8, 4, "native")


@pytest.mark.timeout(120)
def test_native_path_reads_attention_and_mlp_biases(tmp_path) -> None:
    """Llama with attention_bias and mlp_bias (random, non-zero biases): native greedy and log-probs equal HF's."""
    from transformers import AutoModelForCausalLM

    from furlong.models.factory import SIZES, hf_config

    cfg = hf_config("llama", SIZES["tiny"])
    cfg.attention_bias, cfg.mlp_bias = True, True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "m")
    load_tokenizer(create_model("llama", "tiny")).save_pretrained(tmp_path / "m")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    engine = Engine(tmp_path / "m", kv_cache_mb=1, block_size=4).start()
    try:
        assert engine.backend == "NativeModel"
        greedy = SamplingParams(max_new_tokens=N, temperature=0, ignore_eos=True)
        (r,) = engine.generate([Request([5, 6, 7, 8], greedy, return_logprob=True)], timeout=60)
        assert r.output_ids == hf_greedy(hf, [5, 6, 7, 8], N)
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([[5, 6, 7, 8] + r.output_ids])).logits[0], -1)
        want = [lp[3 + i, t].item() for i, t in enumerate(r.output_ids)]
        assert max(abs(a - b) for a, b in zip(want, r.output_logprobs)) < 1e-4
    finally:
        engine.stop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rotation_is_hfs_bit_for_bit_from_a_table_where_the_scaling_allows(dtype) -> None:
    """The native forward's rotary cos/sin come from a table of every position the pool can hold (built by the
    HF rotary module) unless the scaling follows the batch (dynamic), and its rotation of q and k equals HF's
    `apply_rotary_pos_emb` exactly, in fp32 and bf16, whatever the scaling kind."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from furlong.engine.model import build_model
    from furlong.models.factory import SIZES, hf_config

    pos = torch.tensor([0, 3, 17, 31, 5])
    for kind in ("default", "linear", "dynamic"):
        cfg = hf_config("llama", SIZES["tiny"])
        if kind != "default":
            cfg.rope_parameters = {**cfg.rope_parameters, "rope_type": kind, "factor": 2.0}
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
        m = build_model(hf, 8, 4, "native")  # a pool of 32 tokens: positions 0-31
        if kind == "dynamic":
            assert m.rope_table is None
        else:
            assert m.rope_table[0].shape == (32, 1, m.head_dim) and m.rope_table[0].dtype == dtype
        x, cos, sin = m._embed(torch.arange(5), pos)
        q, k = torch.randn(5, m.n_heads, m.head_dim).to(dtype), torch.randn(5, m.n_kv, m.head_dim).to(dtype)
        want_q, want_k = apply_rotary_pos_emb(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], *hf.model.rotary_emb(x[None], pos[None])
        )
        assert torch.equal(m._rope(q, cos, sin), want_q[0].transpose(0, 1)), kind
        assert torch.equal(m._rope(k, cos, sin), want_k[0].transpose(0, 1)), kind
