"""SFT warm-up data: where the demonstrations come from, and the samples they become.

`train.sft_steps` runs supervised steps before RL. Their prompts come from a
demonstrations file (`data.sft_path`) or, without one, from the RL train stream
itself, answered by the synthetic task's reference answer. Each becomes a `Sample`
of exactly the token ids a rollout would produce (prompt, response, end of turn),
with only the response in the loss: the warm-up trains what RL later samples.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from furlong.core.sample import Sample
from furlong.data.chat import conversation_sample, encode_prompt, end_of_turn
from furlong.data.datasets import Prompt, load_dataset
from furlong.data.source import DataSource
from furlong.data.tasks import get_task

if TYPE_CHECKING:
    from furlong.config.schema import DataConfig


def sft_samples(prompts: list[Any], tokenizer: Any, chat: bool) -> list[Sample]:
    """Warm-up samples: prompt + demonstrated response + end of turn; only the response is trained.

    A prompt's response is its `metadata["response"]` (a demonstrations file, `data.sft_path`)
    or else its synthetic task's reference answer. A whole demonstrated conversation
    (`metadata["conversation"]`: tool calls, tool results, several assistant turns) becomes
    the token ids a multi-turn rollout produces, with only the assistant turns trained.
    """
    # The end of turn the template writes after an assistant message (chat), or the EOS token (plain text).
    end = tokenizer.convert_tokens_to_ids(end_of_turn(tokenizer)) if chat else tokenizer.eos_token_id
    out = []
    for i, p in enumerate(prompts):
        if p.metadata.get("conversation"):
            s = conversation_sample(tokenizer, p.prompt, p.metadata.get("tools"))
            s.index = s.group_index = i
            out.append(s)
            continue
        s = Sample(index=i, group_index=i, prompt=p.prompt, tokens=encode_prompt(tokenizer, p.prompt))
        response = p.metadata.get("response")
        if response is None:
            response = get_task(p.metadata["task"]).answer(p.label, chat)
        s.append(tokenizer.encode(response, add_special_tokens=False) + [end], version=0)
        out.append(s)
    return out


def _first_record(path: str) -> Any:
    """The first JSON line of a `.jsonl` demonstrations file (None otherwise): which form its demonstrations take."""
    if not str(path).endswith((".jsonl", ".ndjson")) or not os.path.isfile(path):
        return None
    with open(path) as f:
        for line in f:
            if line.strip():
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    return None  # load_dataset reports it, naming the line
    return None


def sft_source(data: DataConfig, train_source: Any, seed: int) -> Any:
    """Where warm-up prompts come from: the demonstrations file, or the RL train stream itself."""
    d = data
    if not d.sft_path:
        return train_source
    first = _first_record(d.sft_path)
    key = d.messages_key or "messages"
    turns = first.get(key) if isinstance(first, dict) else None
    if isinstance(turns, list) and any(isinstance(m, dict) and m.get("role") == "assistant" for m in turns):
        # Whole conversations: `messages` with the assistant turns (and `tools` when the first line has them).
        demos = load_dataset(
            d.sft_path,
            messages_key=key,
            label_key=None,
            on_error=d.on_error,
            metadata_keys=["tools"] if "tools" in first else [],
        )
        return DataSource(
            [Prompt(p.index, p.prompt, None, {**p.metadata, "conversation": True}) for p in demos], seed=seed
        )
    demos = load_dataset(
        d.sft_path,
        prompt_key=None if d.messages_key else d.prompt_key,
        messages_key=d.messages_key,
        label_key=d.sft_response_key,
        on_error=d.on_error,
    )
    prompts = []
    for p in demos:
        as_chat = d.apply_chat_template and isinstance(p.prompt, str)
        prompt = [{"role": "user", "content": p.prompt}] if as_chat else p.prompt
        prompts.append(Prompt(p.index, prompt, None, {**p.metadata, "response": str(p.label)}))
    return DataSource(prompts, seed=seed)
