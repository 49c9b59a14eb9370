"""A custom reward: partial credit for string reversal, with the exact-match score logged beside it.

The built-in reward of the `reverse` task is exact match: 1 for the whole reversed
string, 0 otherwise. Early in training almost every sample scores 0, so a group's
rewards are all equal and GRPO learns nothing from it. This reward gives a dense
signal instead: the fraction of characters in the right place, so "cba" for
"abc" scores 1.0, "cab" scores 1/3 and "abc" scores 1/3 (the middle letter is right).

It returns a dict: `score` is what advantages use; the other keys (`exact` here) stay
on the sample's `reward`, so `samples/step_<n>.jsonl` shows the real goal beside the
shaped score (the run's `rollout/reward_mean` metric averages `score` only). Any `def reward(sample) -> float | dict` (or `async def`) fits the
`rollout.reward_fn` plug point; see `recipe.yaml` in this folder and docs/plug-points.md.
"""

from __future__ import annotations

from furlong.data.tasks import answer_region, score_string


def answer_of(response_text: str) -> str:
    """The first non-empty line of the answer region, spaces removed (the task's own parsing)."""
    for line in answer_region(response_text).splitlines():
        answer = "".join(line.split()).removesuffix(".")
        if answer:
            return answer
    return ""


def reverse_partial_credit(sample) -> dict[str, float]:
    """Fraction of the label's characters matched position by position; a wrong length costs the rest."""
    label = str(sample.label)
    answer = answer_of(sample.metadata.get("response_text", ""))
    right = sum(a == b for a, b in zip(answer, label))
    return {
        "score": right / max(len(label), len(answer), 1),
        "exact": score_string(sample.metadata.get("response_text", ""), label),
    }
