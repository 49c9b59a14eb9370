"""The rewards library: standard verifiers as `rollout.reward_fn` plug points (`package.module:function`).

- `furlong.rewards.math:math_verify_reward`: math answers through HF's `math-verify` (boxed answers, LaTeX,
  numeric and symbolic equivalence), in a worker process with a furlong timeout;
- `furlong.rewards.math:gsm8k_reward`: GSM8K's final number (`#### 42`, else the last number);
- `furlong.rewards.format:think_answer_format` (and `answer_tag_reward`): `<think>...</think><answer>...</answer>`;
- `furlong.rewards.code:code_tests_reward`: the response's code against the sample's test cases, in the sandbox;
- `furlong.rewards.judge:llm_judge_reward`: a served engine judges the response against the reference.

A floor above `envs/` (the code reward runs in its sandbox), so nothing below imports it: the
composition root loads these by their dotted paths, like any other plug point.
"""
