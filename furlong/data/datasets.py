"""Prompt datasets from JSONL, Parquet and locally saved Hugging Face datasets.

A dataset is read once into a list of `Prompt` records (what a data source
yields; the rollout code turns each into `Sample`s). RL prompt sets are small
next to pre-training corpora (thousands to a few million rows), so holding them
in memory buys exact random access for seeded shuffling and exact resume.

Field mapping (same for every format):

- `prompt_key` names a text field, or `messages_key` a chat-messages field
  (a list of `{"role": str, "content": str}` dicts); give one of them. With
  neither, the text field `"prompt"` is used.
- `label_key` names the answer the reward function checks (any JSON value;
  `None` for unlabelled data). `metadata_keys` are copied into `metadata`.
- A key may be a dotted path into nested objects (`reward_model.ground_truth`,
  the layout verl and Miles parquet files use); a literal key with a dot wins.

Formats, inferred from the path unless `format` is given:

- `jsonl` (`.jsonl`, `.ndjson`): read line by line with a per-line byte limit
  (`max_line_bytes`), so a runaway line is reported instead of eating memory.
  Blank lines are not data and are passed over.
- `parquet` (`.parquet`): read in record batches with pyarrow; errors name the row.
- `hf` (a directory written by `datasets.Dataset.save_to_disk`, or with an explicit
  `format="hf"` a local `.json`/`.jsonl`/`.parquet`/`.csv` file read through
  `datasets.load_dataset`): rows are numbered from 1 in errors. A file `datasets`
  cannot parse at all is reported by file only; read JSONL as `jsonl` to get the line.

Bad input never disappears quietly. With `on_error="raise"` (the default) the first
malformed record raises `DataError` naming the file, the 1-based line (JSONL) or row
(Parquet, HF) and the field. With `on_error="skip"` it is skipped and counted:
`Dataset.skipped` holds the count and `Dataset.skip_reasons` the first few messages,
and a warning is logged. A file that yields no usable record at all is an error
either way, as is a mapped column that the file's schema does not have.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "parquet", "hf")
OnError = Literal["raise", "skip"]
MAX_SKIP_REASONS = 10
DEFAULT_MAX_LINE_BYTES = 16 * 1024 * 1024


@dataclass
class Prompt:
    """One prompt as a data source yields it.

    `index` is the record's position in its dataset: it identifies the prompt in
    data-source checkpoints and in the samples made from it. `prompt` is either
    text or a list of chat messages.
    """

    index: int
    prompt: str | list[dict[str, Any]]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


class DataError(ValueError):
    """Malformed input data; the message names the file, the line or row, and the field."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None, field: str | None = None):
        super().__init__(message)
        self.path, self.line, self.field = path, line, field


class Dataset(Sequence[Prompt]):
    """A loaded list of prompts plus an account of what was skipped and why."""

    def __init__(self, prompts: list[Prompt], source: str, skipped: int = 0, skip_reasons: list[str] | None = None):
        self.prompts = prompts
        self.source = source
        self.skipped = skipped
        self.skip_reasons = list(skip_reasons or [])

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i):  # type: ignore[override]
        return self.prompts[i]

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self.prompts)

    def __repr__(self) -> str:
        return f"Dataset({self.source!r}, {len(self)} prompts, {self.skipped} skipped)"


# ---------------------------------------------------------------- public entry point
def load_dataset(
    path: str | os.PathLike,
    *,
    format: str | None = None,
    prompt_key: str | None = None,
    messages_key: str | None = None,
    label_key: str | None = "label",
    metadata_keys: Sequence[str] = (),
    on_error: OnError = "raise",
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    split: str | None = None,
) -> Dataset:
    """Load prompts from `path`; see the module docstring for formats and field mapping.

    `split` picks one split of a saved `DatasetDict` (HF directories only).
    """
    path = Path(path)
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if prompt_key is not None and messages_key is not None:
        raise ValueError(f"give prompt_key or messages_key, not both (got {prompt_key!r} and {messages_key!r})")
    if max_line_bytes <= 0:
        raise ValueError(f"max_line_bytes must be positive, got {max_line_bytes}")
    if isinstance(metadata_keys, str):
        metadata_keys = (metadata_keys,)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory", path=str(path))
    fmt = format or infer_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if split is not None and fmt != "hf":
        raise ValueError(f"split={split!r} applies to format 'hf' only, not {fmt!r}")
    mapper = _FieldMap(prompt_key, messages_key, label_key, tuple(metadata_keys))

    if fmt == "jsonl":
        records: Iterable[tuple[int, Any]] = _jsonl_records(path, max_line_bytes)
        unit = "line"
    elif fmt == "parquet":
        records = _parquet_records(path, mapper)
        unit = "row"
    else:
        records = _hf_records(path, mapper, split)
        unit = "row"

    prompts: list[Prompt] = []
    skipped, reasons = 0, []
    for number, record in records:
        try:
            if isinstance(record, DataError):
                raise record
            prompts.append(mapper.to_prompt(len(prompts), record, path, unit, number))
        except DataError as err:
            if on_error == "raise":
                raise
            skipped += 1
            if len(reasons) < MAX_SKIP_REASONS:
                reasons.append(str(err))
    if skipped:
        log.warning("%s: skipped %d malformed record(s); first: %s", path, skipped, reasons[0])
    if not prompts:
        detail = f"; first problem: {reasons[0]}" if reasons else ""
        raise DataError(f"{path}: no usable records ({skipped} skipped){detail}", path=str(path))
    return Dataset(prompts, str(path), skipped, reasons)


def infer_format(path: Path) -> str:
    """The format a path's suffix (or being a directory) implies."""
    if path.is_dir():
        return "hf"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    raise DataError(
        f"{path}: cannot infer the format from suffix {suffix!r}; pass format= one of {FORMATS}", path=str(path)
    )


# ---------------------------------------------------------------- field mapping
_MISSING = object()


def _lookup(record: dict[str, Any], key: str) -> Any:
    """`record[key]`, or a walk along a dotted path when the literal key is absent."""
    if key in record:
        return record[key]
    node: Any = record
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


class _FieldMap:
    """Turns one raw record into a Prompt, raising DataError naming the field."""

    def __init__(
        self, prompt_key: str | None, messages_key: str | None, label_key: str | None, metadata_keys: tuple[str, ...]
    ):
        self.messages = messages_key is not None
        self.prompt_key = messages_key if messages_key is not None else (prompt_key or "prompt")
        self.label_key = label_key
        self.metadata_keys = metadata_keys

    @property
    def keys(self) -> list[str]:
        return [self.prompt_key, *([self.label_key] if self.label_key else []), *self.metadata_keys]

    def check_columns(self, columns: Sequence[str], path: Path) -> None:
        """A mapped key that is no column is a configuration error, not a bad row."""
        for key in self.keys:
            top = key if key in columns else key.split(".")[0]
            if top not in columns:
                close = difflib.get_close_matches(top, columns, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise DataError(
                    f"{path}: field {key!r}: no such column{hint}; columns: {list(columns)}", path=str(path), field=key
                )

    def to_prompt(self, index: int, record: Any, path: Path, unit: str, number: int) -> Prompt:
        where = f"{path}:{unit} {number}"

        def fail(key: str | None, problem: str) -> DataError:
            at = f": field {key!r}" if key else ""
            return DataError(f"{where}{at}: {problem}", path=str(path), line=number, field=key)

        if not isinstance(record, dict):
            raise fail(None, f"expected an object, got {type(record).__name__}")

        def get(key: str) -> Any:
            value = _lookup(record, key)
            if value is _MISSING:
                raise fail(key, f"missing (record has {sorted(record)})")
            if value is None:
                raise fail(key, "is null")
            return value

        prompt = get(self.prompt_key)
        if self.messages:
            _check_messages(prompt, lambda problem: fail(self.prompt_key, problem))
        elif not isinstance(prompt, str):
            raise fail(self.prompt_key, f"expected a string, got {type(prompt).__name__}")
        elif not prompt.strip():
            raise fail(self.prompt_key, "is empty")
        label = get(self.label_key) if self.label_key else None
        metadata = {key: get(key) for key in self.metadata_keys}
        return Prompt(index=index, prompt=prompt, label=label, metadata=metadata)


def _check_messages(messages: Any, fail) -> None:
    if not isinstance(messages, list) or not messages:
        raise fail(f"expected a non-empty list of messages, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise fail(f"message {i}: expected an object, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise fail(f"message {i}: 'role' must be a string")
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise fail(f"message {i}: 'content' must be a string")


# ---------------------------------------------------------------- readers
def _jsonl_records(path: Path, max_line_bytes: int) -> Iterator[tuple[int, Any]]:
    """Yield (line number, parsed object or DataError) for every non-blank line.

    Lines are read with a byte limit so one enormous line cannot exhaust memory;
    its remainder is consumed in bounded chunks and reported as one bad line.
    """
    with open(path, "rb") as f:
        number = 0
        while True:
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                return
            number += 1
            where = f"{path}:line {number}"
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                size = len(raw)
                while raw and not raw.endswith(b"\n"):
                    raw = f.readline(1 << 20)
                    size += len(raw) - raw.endswith(b"\n")
                yield (
                    number,
                    DataError(
                        f"{where}: line is {size} bytes, over max_line_bytes={max_line_bytes}",
                        path=str(path),
                        line=number,
                    ),
                )
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield number, DataError(f"{where}: invalid UTF-8 at byte {e.start}", path=str(path), line=number)
                continue
            if not text.strip():
                continue
            try:
                yield number, json.loads(text)
            except json.JSONDecodeError as e:
                yield (
                    number,
                    DataError(f"{where}: invalid JSON: {e.msg} at column {e.colno}", path=str(path), line=number),
                )


def _parquet_records(path: Path, mapper: _FieldMap) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable parquet file: {e}", path=str(path)) from e
    mapper.check_columns(pf.schema_arrow.names, path)
    number = 0
    for batch in pf.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            number += 1
            yield number, row


def _hf_records(path: Path, mapper: _FieldMap, split: str | None) -> Iterator[tuple[int, Any]]:
    import datasets

    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
        else:
            builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(path.suffix.lower())
            if builder is None:
                raise DataError(
                    f"{path}: format 'hf' reads a saved dataset directory or a .json/.jsonl/.parquet/.csv file",
                    path=str(path),
                )
            ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{path}: cannot load with datasets: {type(e).__name__}: {e}", path=str(path)) from e
    if isinstance(ds, datasets.DatasetDict):
        if split is None or split not in ds:
            raise DataError(
                f"{path}: holds splits {sorted(ds)}; pass split= one of them (got {split!r})", path=str(path)
            )
        ds = ds[split]
    elif split is not None:
        raise DataError(f"{path}: holds a single dataset, not splits; drop split={split!r}", path=str(path))
    mapper.check_columns(ds.column_names, path)
    yield from enumerate(ds, start=1)
