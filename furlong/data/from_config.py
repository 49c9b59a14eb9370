"""Build the train data source and the held-out prompts a run's `data` section describes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from furlong.data.datasets import Dataset, Prompt, load_dataset
from furlong.data.source import DataSource
from furlong.data.tasks import get_task

if TYPE_CHECKING:
    from furlong.config.schema import Config, DataConfig, MixTask


def _file(d: DataConfig, path: str) -> Dataset:
    return load_dataset(
        path,
        format=None if d.format == "auto" else d.format,
        prompt_key=None if d.messages_key else d.prompt_key,
        messages_key=d.messages_key,
        label_key=d.label_key,
        metadata_keys=d.metadata_keys,
        on_error=d.on_error,
    )


def _as_chat(prompts: list[Prompt]) -> list[Prompt]:
    return [
        Prompt(p.index, [{"role": "user", "content": p.prompt}], p.label, p.metadata)
        if isinstance(p.prompt, str)
        else p
        for p in prompts
    ]


def _mix(cfg: Config, split: str, n: int) -> list[Prompt]:
    """`data.mix`: `n` prompts of each task, interleaved (a, b, a, b, ...), re-indexed, each tagged with its
    task's adapter in `metadata["adapter"]` (what the rollout sends as `lora_path` and the trainer groups by)."""
    parts = [_mix_part(cfg, m, split, n) for m in cfg.data.mix]
    out: list[Prompt] = []
    for i in range(n):
        for part in parts:
            p = part[i]
            out.append(Prompt(len(out), p.prompt, p.label, p.metadata))
    return out


def _mix_part(cfg: Config, m: MixTask, split: str, n: int) -> list[Prompt]:
    d, seed = cfg.data, cfg.seed + (split == "eval")
    made = get_task(m.task).make(
        split, n, seed=seed, difficulty=m.difficulty or d.difficulty, chat=d.apply_chat_template
    )
    tag = {"adapter": m.adapter} if m.adapter is not None else {}
    return [Prompt(p.index, p.prompt, p.label, {**p.metadata, **tag}) for p in made]


def build_data(cfg: Config) -> tuple[DataSource, list[Prompt]]:
    """(train DataSource, eval prompts). Synthetic tasks put their name in each prompt's metadata,
    which is how the default reward finds its scorer.

    Takes the whole config, not only its `data` section: the seed orders the data, and the
    `rollout.data_source` plug point, when set, replaces the train prompts (it is handed the config).
    """
    d = cfg.data
    chat = d.apply_chat_template
    if d.mix:
        train = _mix(cfg, "train", -(-(d.n_train or 20000) // len(d.mix)))  # n_train and n_eval: in all
    elif d.path:
        train = list(_file(d, d.path))
        if chat:
            train = _as_chat(train)
    else:
        train = list(
            get_task(d.task).make("train", d.n_train or 20000, seed=cfg.seed, difficulty=d.difficulty, chat=chat)
        )
    if d.mix:
        evals = _mix(cfg, "eval", -(-d.n_eval // len(d.mix)))
    elif d.eval_path:
        evals = list(_file(d, d.eval_path))
        evals = _as_chat(evals) if chat else evals
    elif d.eval_task or d.task:
        evals = list(
            get_task(d.eval_task or d.task).make(
                "eval", d.n_eval, seed=cfg.seed + 1, difficulty=d.difficulty, chat=chat
            )
        )
    else:
        evals = []
    source = cfg.rollout.data_source
    if source:  # the `rollout.data_source` plug point replaces the train prompts the data section describes
        from furlong.config.registry import load_plugin

        return load_plugin("rollout.data_source", source)(config=cfg, seed=cfg.seed), evals
    return DataSource(train, seed=cfg.seed, shuffle=d.shuffle), evals
