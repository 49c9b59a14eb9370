"""Every recipe in recipes/ is trained: a shortened run of each, asserting the estimator it names ran
(metrics only that estimator logs) and that its objective improved by a stated margin.

Cost: the RL recipes share one warm topology (one trainer actor, one engine, one router, started
once for the module): each `Run(cfg, topology=...)` rebuilds the trainer from its own recipe's
`train` and `algo` sections and pushes its initial weights to the engine before sampling. Every
run is cut to a tiny model, 4 prompts x 4 samples, 8-token responses.

The learning signal: the arithmetic task gives a random tiny model reward 0 everywhere, which
teaches nothing in 8 steps, so the RL runs use `odd_tokens` (below): the fraction of response
tokens with an odd id, sampled with `rollout.top_k=4` so each choice is among the model's 4
likeliest tokens. It is ~0.5 at initialisation, varies within a group, and every estimator here
raises it to ~1.0 in 8 steps; DAPO gets the binary `odd_majority` so that some groups agree and its
dynamic filter has something to drop. What must improve is the held-out evaluation the run itself
makes before and after RL (`EVAL_MARGIN` on `eval/mean_reward`: one sample per held-out prompt at the
run's sampling settings, 8 prompts): it scores the trained policy, not the sampling noise of 16
samples a step. The training reward's gain (last steps over the first) was the criterion before; it
failed a correct run (PPO reached 0.99 by step 3, a first window already high, or dipped to 0.07 for a
step and recovered) and passed one that learned nothing (DAPO at a learning rate of 1e-9: 0.34 -> 0.44
from sampling noise alone). Measured over seeds 0-3 of every RL recipe here, as this module runs them
(`FURLONG_TEST_RECIPES_SEED`): eval gain 0.27-0.65, the lowest PPO's at seed 2 (0.37 -> 0.64). With
`FURLONG_TEST_RECIPES_LR=1e-9` (no learning) before equals after and every RL test fails on it.

Every run is seeded and the same run at any machine load (`SEEDED`): a fully async recipe runs with
`rollout.max_staleness=0` (the async producer, buffer and partial rollouts still run, and train exactly
the samples sync would), an overlap recipe in sync mode. Why: with staleness allowed, the machine's
speed decides which weights sampled what, and at these learning rates one stale step can undo the
run. Seen on loaded clean-clone runs: PPO in overlap 0.53 -> 0.56 on held-out eval while its training
reward rose 0.45 -> 0.93; the demo recipe (async, staleness 1) 0.61 -> 0.67 although its training
reward was 1.0 for its last four steps; RLOO in overlap 0.53 -> 0.63. The estimators are the same in
every mode; the modes themselves are tested by the runs that need them (tests/unit/test_rollout_manager.py,
tests/integration/test_rl_runs.py, the benchmarks' smoke test).

SFT runs with no engine at all (the check: the run reports no engine started and no new
`furlong serve` process appears on the machine while it trains), and its held-out NLL on the
reference answers must drop by `SFT_NLL_DROP`. The distillation run reuses that SFT run (on a
parity task a tiny model learns in 40 steps), exported, as its teacher: the student (a fresh
model, warmed up by a few SFT steps) must close at least half of the teacher-student gap in
held-out sampled accuracy (pass@1).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
HERE = __name__  # how pytest imported this module: the reward plug points below are named through it
STEPS = 8
EVAL_MARGIN = 0.2  # held-out eval/mean_reward, after RL over before (seeds 0-3 x 10 recipes: 0.27 at least)
# Per rollout mode: what makes a recipe's run seeded, the same run at any load (see the module docstring).
SEEDED = {"sync": [], "async": ["rollout.max_staleness=0"], "overlap": ["rollout.mode=sync"]}
SFT_NLL_DROP = 0.5  # nats per token, held-out
OPD_STEPS = 24
MATH_GAIN = 0.15  # held-out sampled pass@1, after GRPO over after the SFT warm-up
SFT_BATCH = ["train.global_batch_size=16", "rollout.rollout_batch_size=16", "rollout.n_samples_per_prompt=1"]
# Checks that the margins can fail: with FURLONG_TEST_RECIPES_LR=1e-9 no run learns and every RL test fails (it
# also wins over a recipe's own learning rate below).
LR = os.environ.get("FURLONG_TEST_RECIPES_LR")
SEED = os.environ.get("FURLONG_TEST_RECIPES_SEED")  # another seed for every run here (the margins' measurement)
SHORT = [
    *([f"seed={SEED}"] if SEED else []),
    "model.size=tiny",
    "observe.tensorboard=false",
    "train.sft_steps=0",
    "train.checkpoint_every=0",
    "train.checkpoint_every_min=0",
    "rollout.eval_every=0",
    "rollout.rollout_batch_size=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=8",
    "rollout.top_k=4",  # the policy chooses among its 4 likeliest tokens: a choice a tiny model can shift in 8 steps
    "data.n_eval=8",
    "engine.num_engines=1",
    f"train.total_steps={STEPS}",
    f"train.lr={LR or '2e-2'}",
    "train.warmup_steps=0",
]


def odd_tokens(sample: Any) -> float:
    """The fraction of response tokens whose id is odd: dense, ~0.5 at init, learnable in a few steps."""
    resp = sample.tokens[sample.prompt_length :]
    return sum(t % 2 for t in resp) / max(len(resp), 1)


def odd_majority(sample: Any) -> float:
    """1 when most response tokens have odd ids: binary, so whole groups sometimes agree (DAPO filters them)."""
    return float(odd_tokens(sample) > 0.5)


def _config(recipe: str, overrides: list[str], tmp: Path) -> Any:
    from furlong.config import load_config

    return load_config(str(RECIPES / f"{recipe}.yaml"), [*SHORT, f"run_dir={tmp / recipe}", *overrides])


def _metrics(run_dir: str) -> list[dict[str, float]]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_learned(result: dict[str, Any], name: str) -> None:
    """The held-out evaluation after RL beats the one before by `EVAL_MARGIN` (see the module docstring)."""
    before, after = result["before"]["eval/mean_reward"], result["after"]["eval/mean_reward"]
    assert after - before >= EVAL_MARGIN, f"{name}: held-out eval reward {before:.3f} -> {after:.3f} (< {EVAL_MARGIN})"


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """One started topology (tiny model, one engine, router, one trainer rank) for every RL recipe here."""
    from furlong.driver import build
    from furlong.driver.rundir import admin_token

    tmp = tmp_path_factory.mktemp("recipes")
    # Logical CPUs to spare (threads stay at one per process): the engine-free SFT run places its own trainer
    # beside this topology, and Ray admits a placement group only into free logical CPUs.
    cfg = _config("debug", ["cluster.num_cpus=6", "cluster.threads_per_process=1"], tmp)
    plugs = build.plugins(cfg)
    build.start_ray(cfg)
    (tmp / "warm").mkdir()
    top = build.topology(cfg, tmp / "warm", build.model_dir(cfg.model), admin_token(tmp / "warm"), plugs)
    yield top, tmp
    top.shutdown()


def _run(cfg: Any, top: Any = None) -> dict[str, Any]:
    from furlong.driver.run import Run

    return asyncio.run(Run(cfg, progress=False, topology=top).run())


# recipe -> (extra overrides, metric keys only its estimator logs)
RL = {
    "debug": ([], ["advantage/grpo/abs_mean"]),
    "grpo_arithmetic": (["train.lr=1e-2"], ["advantage/grpo/abs_mean"]),  # async + partial: 2e-2 overshoots
    "dr_grpo_arithmetic": ([], ["advantage/dr_grpo/abs_mean"]),
    "gspo_arithmetic": ([], ["policy/seq_ratio_mean", "policy/seq_clip_frac"]),
    "rloo_arithmetic": ([], ["advantage/rloo/abs_mean"]),
    "reinforce_pp_arithmetic": ([], ["advantage/reinforce_pp/returns_mean", "policy/kl_ref"]),
    "reinforce_pp_baseline_arithmetic": ([], ["advantage/reinforce_pp_baseline/returns_mean"]),
    "ppo_arithmetic": (  # at 2e-2 in its overlap mode: 0.27-0.94 in three loaded runs
        ["train.lr=1e-2"],
        ["loss/value", "critic/grad_norm", "value/clip_frac", "advantage/gae/returns_mean"],
    ),
    "fault_tolerant": ([], ["advantage/grpo/abs_mean"]),
    "demo": (["data.n_train=2000"], ["advantage/grpo/abs_mean"]),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("recipe", sorted(RL))
def test_rl_recipe_trains_its_estimator(recipe, warm):
    top, tmp = warm
    extra, keys = RL[recipe]
    seeded = SEEDED[_config(recipe, [], tmp).rollout.mode]
    lr = [f"train.lr={LR}"] if LR else []
    cfg = _config(recipe, [*extra, *seeded, *lr, f"rollout.reward_fn={HERE}:odd_tokens"], tmp)
    result = _run(cfg, top)
    assert result["steps"] == STEPS
    rows = _metrics(result["run_dir"])
    assert all(r.get("rollout/staleness_max", 0) == 0 for r in rows), f"{recipe}: a stale sample was trained"
    if cfg.rollout.mode == "async":
        assert result["rollout_stats"]["mode"] == "async", result["rollout_stats"]
    for key in keys:
        assert any(key in r for r in rows), f"{recipe}: no step logged {key} (algo.name={cfg.algo.name})"
    ran = {k.split("/")[1] for r in rows for k in r if k.startswith("advantage/")}
    assert ran == {cfg.algo.advantage}, f"{recipe}: advantage metrics of {ran}, expected only {cfg.algo.advantage}"
    sequence = any("policy/seq_ratio_mean" in r for r in rows)
    assert sequence == (cfg.algo.ratio_type == "sequence"), f"{recipe}: sequence-ratio metrics {sequence}"
    assert_learned(result, recipe)


@pytest.mark.timeout(900)
def test_dapo_recipe_filters_and_clips_higher(warm):
    top, tmp = warm
    # A smaller step than the others: at 2e-2 (and 5e-3) the policy saturated within 3 steps (every sample
    # majority-odd), every group then agreed, and dynamic sampling kept drawing prompts without ever filling a batch
    # (the manager has no cap on those rounds; see docs/recipes.md).
    # Even at 1.5e-3 it stalled so at step 6, so the run stops after 4 steps. The recipe's async mode lets the
    # machine's speed decide which weights sampled what (a loaded run saturated by step 3), so the test runs it in
    # sync mode: seeded, the same 4 steps every time; the estimator and the filters are the same in both modes.
    # The seed matters here: at seed 3 the fresh model already answers majority-odd (held-out 0.625 before RL, 0.125
    # at seed 0), most groups agree from the start, and dynamic sampling stalls at step 2 at 7e-4 and at 5e-4 alike.
    overrides = [f"rollout.reward_fn={HERE}:odd_majority", "rollout.over_sampling=2", f"train.lr={LR or 7e-4}"]
    overrides.append("rollout.mode=sync")
    overrides.append("train.total_steps=4")
    cfg = _config("dapo_arithmetic", overrides, tmp)
    assert (cfg.algo.clip_eps_high, cfg.algo.loss_reducer, cfg.rollout.dynamic_filter) == (0.28, "token_mean", True)
    result = _run(cfg, top)
    rows = _metrics(result["run_dir"])
    assert result["rollout_stats"]["filtered"].get("zero_variance", 0) >= 1, result["rollout_stats"]
    assert all("policy/clip_frac_high" in r for r in rows)
    assert_learned(result, "dapo")


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _engines() -> set[int]:
    """Every `furlong serve` process descended from this test process (our Ray's workers start them), so other
    work on the machine does not count."""
    out, me = set(), os.getpid()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serve" in cmd and any(b"furlong" in c for c in cmd):
                pid = int(d)
                while pid > 1 and pid != me:
                    pid = _ppid(pid)
                if pid == me:
                    out.add(int(d))
    return out


def parity_match(sample: Any) -> float:
    """The parity task's reward: the first word of the response is the label (`odd` / `even`)."""
    return float(str(sample.metadata.get("response_text", "")).strip().lower().split()[:1] == [sample.label])


def _parity_files(tmp: Path) -> list[str]:
    """A task a tiny model learns in a few dozen SFT steps and that generalises to unseen numbers:
    "Is 37 odd or even? Answer:" -> " odd" (train on 10..79, evaluate on 80..99). Data overrides for a recipe."""
    for name, numbers in (("train", range(10, 80)), ("eval", range(80, 100))):
        lines = []
        for n in numbers:
            label = "odd" if n % 2 else "even"
            lines.append(
                json.dumps({"prompt": f"Is {n} odd or even? Answer:", "label": label, "response": f" {label}"})
            )
        (tmp / f"parity_{name}.jsonl").write_text("\n".join(lines) + "\n")
    return [
        "data.task=null",
        "data.eval_task=null",
        f"data.path={tmp / 'parity_train.jsonl'}",
        f"data.eval_path={tmp / 'parity_eval.jsonl'}",
        f"data.sft_path={tmp / 'parity_train.jsonl'}",
        "data.metadata_keys=[response]",
        "data.n_eval=20",
    ]


@pytest.fixture(scope="module")
def sft_teacher(warm):
    """recipes/sft_reverse_teacher.yaml on the parity data, engine-free; (result, exported HF dir, engines seen)."""
    from furlong.driver.run import Run
    from furlong.train.export import export, resolve

    _, tmp = warm
    cfg = _config(
        "sft_reverse_teacher", [*_parity_files(tmp), *SFT_BATCH, "train.total_steps=40", "rollout.eval_every=20"], tmp
    )
    before = _engines()  # the warm topology's engine was there already
    assert before, "the scan must see the warm topology's engine, or it could not see one an SFT run started"
    seen: set[int] = set()

    async def watch() -> None:
        while True:
            seen.update(_engines() - before)
            await asyncio.sleep(0.5)

    async def go() -> dict[str, Any]:
        task = asyncio.create_task(watch())
        try:
            return await Run(cfg, progress=False).run()
        finally:
            task.cancel()

    result = asyncio.run(go())
    hf = export(resolve(result["run_dir"]), tmp / "teacher_hf")
    return result, hf, seen


@pytest.mark.timeout(900)
def test_sft_recipe_trains_without_an_engine(sft_teacher):
    result, _, seen = sft_teacher
    assert result["engines_started"] == 0 and not seen, f"engine processes during an SFT run: {seen}"
    before, after = result["before"]["eval/sft_nll"], result["after"]["eval/sft_nll"]
    assert before - after >= SFT_NLL_DROP, f"held-out NLL {before:.3f} -> {after:.3f}"
    assert result["after"]["eval/greedy_match_lower_bound"] >= 0.9, result["after"]  # the teacher OPD needs
    rows = _metrics(result["run_dir"])
    assert all("loss/sft" in r and "sft/nll_token_mean" in r for r in rows)
    assert not any("rollout/reward_mean" in r for r in rows)  # nothing was sampled


@pytest.mark.timeout(900)
def test_sft_arithmetic_recipe_trains(warm):
    """On the warm topology's trainer (the engine-free start is checked above): the engine is never used."""
    top, tmp = warm
    cfg = _config("sft_arithmetic", [*SFT_BATCH, "train.total_steps=20", "train.warmup_steps=2"], tmp)
    result = _run(cfg, top)
    assert result["engines_started"] == 0
    drop = result["before"]["eval/sft_nll"] - result["after"]["eval/sft_nll"]
    assert drop >= SFT_NLL_DROP, f"held-out NLL dropped {drop:.3f}"


@pytest.mark.timeout(900)
def test_opd_student_closes_half_the_gap(warm, sft_teacher):
    """The student is a fresh tiny model (the teacher's initialisation and tokenizer), warmed up on a few reference
    answers (so it answers in the format, at chance), then trained on the teacher's per-token log-probs alone:
    the task reward is logged, never trained on. Accuracy is sampled pass@1 over 4 samples per held-out prompt."""
    top, tmp = warm
    _, teacher, _ = sft_teacher
    cfg = _config(
        "opd_reverse",
        [
            *_parity_files(tmp),
            f"algo.teacher_path={teacher}",
            f"rollout.reward_fn={HERE}:parity_match",
            "rollout.eval_n_samples=4",
            "train.sft_steps=12",
            "train.sft_lr=3e-3",
            "train.lr=3e-3",
            "rollout.rollout_batch_size=8",
            "rollout.n_samples_per_prompt=2",
            f"train.total_steps={OPD_STEPS}",
        ],
        tmp,
    )
    result = _run(cfg, top)
    rows = _metrics(result["run_dir"])
    stepped = [r for r in rows if "loss/distill" in r]
    assert len(stepped) == OPD_STEPS and all("distill/reverse_kl" in r and "teacher/logprob_mean" in r for r in stepped)
    key = "eval/pass@1"
    t, s0, s1 = result["teacher"][key], result["before"][key], result["after"][key]
    print(f"OPD: teacher {t:.3f}, student {s0:.3f} -> {s1:.3f} ({key})")
    assert t - s0 >= 0.25, f"teacher {t:.3f} vs student {s0:.3f}: no gap to close"
    assert s1 - s0 >= (t - s0) / 2, f"student {s0:.3f} -> {s1:.3f}, teacher {t:.3f}: gained less than half the gap"


@pytest.mark.timeout(900)
def test_math_word_recipe_is_scored_by_math_verify(warm):
    """The math recipe, shortened, on its easy problems (`make_math_word.py --easy`: one step, the answer in the
    prompt, so a tiny model can learn it in a test's budget): its SFT warm-up on the reference answers teaches the
    `\\boxed{}` form, then GRPO on math-verify's reward (in its worker process) must raise held-out sampled
    pass@1 by `MATH_GAIN` over the warmed-up model's (measured: 0.125 -> 0.40 in 8 steps). Every sample is
    scored (no reward error, no timeout), and on the recipe's own (multi-step) data math-verify accepts each
    reference answer and rejects each reference paired with another problem's label. With
    `FURLONG_TEST_RECIPES_LR=1e-9` GRPO changes nothing and the margin fails."""
    import importlib.util

    from furlong.rewards.math import check

    top, tmp = warm
    spec = importlib.util.spec_from_file_location("make_math_word", RECIPES / "data" / "make_math_word.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    easy = tmp / "math_word_easy"
    easy.mkdir()
    train, held_out = maker.write(easy, easy=True)
    overrides = [
        f"data.path={train}",
        f"data.eval_path={held_out}",
        f"data.sft_path={train}",
        "rollout.max_new_tokens=12",  # " \\boxed{7}" is 10 tokens
        "train.sft_steps=40",
        "train.sft_lr=3e-3",
        f"train.lr={os.environ.get('FURLONG_TEST_RECIPES_LR', '2e-3')}",
        f"train.total_steps={STEPS}",
    ]
    cfg = _config("math_word", overrides, tmp)
    assert cfg.rollout.reward_fn == "furlong.rewards.math:math_verify_reward"
    result = _run(cfg, top)
    steps = [r for r in _metrics(result["run_dir"]) if "rollout/reward_mean" in r]
    assert len(steps) == STEPS and all(r["rollout/reward/timeout"] == 0.0 for r in steps)
    assert result["rollout_stats"]["reward_errors"] == 0 and result["after"]["eval/failed"] == 0
    before, after = result["before"]["eval/pass@1"], result["after"]["eval/pass@1"]
    print(f"math_word: held-out pass@1 {before:.3f} -> {after:.3f} after {STEPS} GRPO steps")
    assert after - before >= MATH_GAIN, f"held-out pass@1 {before:.3f} -> {after:.3f}: gained less than {MATH_GAIN}"
    rows = [json.loads(line) for line in (RECIPES / "data" / "math_word_eval.jsonl").read_text().splitlines()]

    async def verdicts() -> tuple[list[bool], list[bool]]:
        right = [(await check(r["label"], r["response"]))[0] for r in rows]
        labels = {r["label"] for r in rows}
        wrong = [
            (await check(r["label"], f"\\boxed{{{next(x for x in sorted(labels) if x != r['label'])}}}"))[0]
            for r in rows
        ]
        return right, wrong

    right, wrong = asyncio.run(verdicts())
    assert all(right) and not any(wrong), (right, wrong)
