"""A custom data source: two synthetic tasks mixed into one shuffled, resumable stream.

A data source is any object with `next_batch`, `push_back`, `state_dict` and
`load_state_dict` (`furlong.data.PromptSource`); the simplest way to write one is
to build a list of `Prompt`s and wrap it in the built-in `DataSource`, which then
handles epochs, shuffling, push-back and exact resume. Each prompt keeps its
task's name in `metadata["task"]`, so a reward function can dispatch on it:
`TASKS[prompt.metadata["task"]].score(response, prompt.label)`.

Point the data-source plug point at `examples.data_source.mixed_tasks:build`.
"""

from __future__ import annotations

from dataclasses import replace

from furlong.data import TASKS, DataSource


def build(seed: int = 0, n_per_task: int = 200, tasks: tuple[str, ...] = ("arithmetic", "reverse")) -> DataSource:
    """A DataSource over `n_per_task` train prompts of each task, re-indexed 0..n-1."""
    prompts = []
    for name in tasks:
        for p in TASKS[name].make("train", n_per_task, seed=seed):
            prompts.append(replace(p, index=len(prompts)))
    return DataSource(prompts, seed=seed)
