"""Data: prompt datasets from files, synthetic tasks with rewards, and a resumable data source.

    from furlong.data import load_dataset, TASKS, DataSource

    ds = load_dataset("train.jsonl", prompt_key="question", label_key="answer")
    ds = TASKS["arithmetic"].make("train", n=1000, seed=0, difficulty=1)
    source = DataSource(ds, seed=0)
    batch = source.next_batch(8)          # list[Prompt]
    reward = TASKS["arithmetic"].score("Answer: 8", 8)

See each module's docstring: `datasets` (formats, field mapping, errors),
`tasks` (task definitions and the reward rule), `source` (epochs, push-back, resume).
"""

from furlong.data.datasets import DataError, Dataset, Prompt, load_dataset
from furlong.data.source import DataSource, PromptSource
from furlong.data.tasks import CALCULATOR_TOOL, TASKS, Task, calculate, get_task

__all__ = [
    "CALCULATOR_TOOL",
    "DataError",
    "DataSource",
    "Dataset",
    "Prompt",
    "PromptSource",
    "TASKS",
    "Task",
    "calculate",
    "get_task",
    "load_dataset",
]
