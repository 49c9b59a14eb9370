"""Datasets: every format, field mapping, and every malformed-input case naming file + line + field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from furlong.data import DataError, Dataset, Prompt, load_dataset

ROWS = [
    {"question": "What is 1 + 1?", "answer": 2, "source": "a", "extra": {"gt": "two"}},
    {"question": "What is 2 + 2?", "answer": 4, "source": "b", "extra": {"gt": "four"}},
    {"question": "What is 3 + 3?", "answer": 6, "source": "c", "extra": {"gt": "six"}},
]
MESSAGES = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": r["question"]}] for r in ROWS]
MAPPING = dict(prompt_key="question", label_key="answer", metadata_keys=["source"])


def write_jsonl(path: Path, lines: list) -> Path:
    """Write `lines` (dicts are JSON-encoded, bytes and str written as they are) one per line."""
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            f.write(line if isinstance(line, bytes) else line.encode())
            f.write(b"\n")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def expected(mapping_rows=ROWS) -> list[Prompt]:
    return [Prompt(i, r["question"], r["answer"], {"source": r["source"]}) for i, r in enumerate(mapping_rows)]


@pytest.fixture()
def hf_cache(tmp_path, monkeypatch):
    """Keep `datasets`' arrow cache for loaded files out of the home directory."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


# ---------------------------------------------------------------- formats
def test_jsonl_with_field_mapping(tmp_path):
    ds = load_dataset(write_jsonl(tmp_path / "d.jsonl", ROWS), **MAPPING)
    assert isinstance(ds, Dataset) and list(ds) == expected() and ds.skipped == 0


def test_parquet_with_field_mapping(tmp_path):
    ds = load_dataset(write_parquet(tmp_path / "d.parquet", ROWS), **MAPPING)
    assert list(ds) == expected()


def test_hf_saved_directory_and_split(tmp_path):
    import datasets

    hd = datasets.Dataset.from_list(ROWS)
    hd.save_to_disk(str(tmp_path / "single"))
    assert list(load_dataset(tmp_path / "single", **MAPPING)) == expected()

    datasets.DatasetDict({"train": hd, "test": hd.select([2])}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"holds splits \['test', 'train'\]; pass split="):
        load_dataset(tmp_path / "dict", **MAPPING)
    test = load_dataset(tmp_path / "dict", split="test", **MAPPING)
    assert [p.prompt for p in test] == [ROWS[2]["question"]]


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_hf_local_files(tmp_path, hf_cache, suffix):
    path = tmp_path / f"d{suffix}"
    write_parquet(path, ROWS) if suffix == ".parquet" else write_jsonl(path, ROWS)
    assert list(load_dataset(path, format="hf", **MAPPING)) == expected()


def test_messages_key_and_dotted_label(tmp_path):
    rows = [{"messages": m, "reward_model": {"ground_truth": r["answer"]}} for m, r in zip(MESSAGES, ROWS)]
    for path in (write_jsonl(tmp_path / "m.jsonl", rows), write_parquet(tmp_path / "m.parquet", rows)):
        ds = load_dataset(path, messages_key="messages", label_key="reward_model.ground_truth")
        assert [p.prompt for p in ds] == MESSAGES
        assert [p.label for p in ds] == [2, 4, 6]


def test_defaults_unlabelled_and_nested_metadata(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "label": "x", "extra": {"gt": "y"}}])
    assert load_dataset(path)[0] == Prompt(0, "hi", "x", {})
    assert load_dataset(path, label_key=None)[0].label is None
    assert load_dataset(path, metadata_keys="extra.gt")[0].metadata == {"extra.gt": "y"}


def test_blank_lines_are_not_data_but_count_as_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], "", "   ", ROWS[1], "{bad"])
    with pytest.raises(DataError, match=r"d\.jsonl:line 5: invalid JSON"):
        load_dataset(path, **MAPPING)
    ds = load_dataset(path, on_error="skip", **MAPPING)
    assert [p.index for p in ds] == [0, 1] and ds.skipped == 1


# ---------------------------------------------------------------- malformed input
BAD_LINES = [
    ("{not json", r"line 2: invalid JSON", None),
    (b'{"question": "\xff\xfe", "answer": 1, "source": "x"}', r"line 2: invalid UTF-8 at byte 14", None),
    ({"answer": 1, "source": "x"}, r"line 2: field 'question': missing", "question"),
    ({"question": "q", "source": "x"}, r"line 2: field 'answer': missing", "answer"),
    ({"question": "q", "answer": 1}, r"line 2: field 'source': missing", "source"),
    ({"question": 7, "answer": 1, "source": "x"}, r"line 2: field 'question': expected a string, got int", "question"),
    ({"question": " ", "answer": 1, "source": "x"}, r"line 2: field 'question': is empty", "question"),
    ({"question": "q", "answer": None, "source": "x"}, r"line 2: field 'answer': is null", "answer"),
    ("[1, 2]", r"line 2: expected an object, got list", None),
]


@pytest.mark.parametrize("bad,message,field", BAD_LINES)
def test_bad_line_names_file_line_and_field(tmp_path, bad, message, field):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], bad, ROWS[1]])
    with pytest.raises(DataError, match=str(path).replace(".", r"\.") + ":" + message) as err:
        load_dataset(path, **MAPPING)
    assert (err.value.path, err.value.line, err.value.field) == (str(path), 2, field)

    ds = load_dataset(path, on_error="skip", **MAPPING)
    assert [p.prompt for p in ds] == [ROWS[0]["question"], ROWS[1]["question"]]
    assert [p.index for p in ds] == [0, 1]
    assert ds.skipped == 1 and len(ds.skip_reasons) == 1 and "line 2" in ds.skip_reasons[0]


@pytest.mark.parametrize(
    "messages,problem",
    [
        ("hello", "expected a non-empty list of messages, got str"),
        ([], "expected a non-empty list of messages, got list"),
        (["hi"], "message 0: expected an object, got str"),
        ([{"content": "hi"}], "message 0: 'role' must be a string"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], "message 1: 'content' must be a string"),
    ],
)
def test_bad_messages(tmp_path, messages, problem):
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": messages}])
    with pytest.raises(DataError, match=rf"line 1: field 'messages': {problem}"):
        load_dataset(path, messages_key="messages", label_key=None)


def test_huge_line_over_byte_limit(tmp_path):
    big = {"question": "x" * 5000, "answer": 1, "source": "s"}
    path = write_jsonl(tmp_path / "big.jsonl", [ROWS[0], big, ROWS[1]])
    size = len(json.dumps(big))
    with pytest.raises(DataError, match=rf"big\.jsonl:line 2: line is {size} bytes, over max_line_bytes=1000"):
        load_dataset(path, max_line_bytes=1000, **MAPPING)
    ds = load_dataset(path, max_line_bytes=1000, on_error="skip", **MAPPING)
    assert len(ds) == 2 and ds.skipped == 1
    # A limit exactly at the line's length admits it; one byte less does not.
    assert len(load_dataset(path, max_line_bytes=size, **MAPPING)) == 3
    with pytest.raises(DataError, match="line 2"):
        load_dataset(path, max_line_bytes=size - 1, **MAPPING)


def test_huge_last_line_without_newline(tmp_path):
    path = tmp_path / "tail.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b"\n" + b'{"question": "' + b"y" * 3000)
    with pytest.raises(DataError, match=r"line 2: line is 3014 bytes"):
        load_dataset(path, max_line_bytes=2000, **MAPPING)


def test_skip_counts_every_bad_line_and_keeps_first_reasons(tmp_path):
    lines = [ROWS[0]] + ["{bad"] * 25 + [ROWS[1]]
    ds = load_dataset(write_jsonl(tmp_path / "d.jsonl", lines), on_error="skip", **MAPPING)
    assert len(ds) == 2 and ds.skipped == 25
    assert len(ds.skip_reasons) == 10 and ds.skip_reasons[0].endswith(
        "line 2: invalid JSON: Expecting property name enclosed in double quotes at column 2"
    )
    assert "line 11:" in ds.skip_reasons[-1]


def test_nothing_usable_is_an_error_even_when_skipping(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "a"}, {"q": "b"}])
    with pytest.raises(
        DataError, match=r"no usable records \(2 skipped\); first problem: .*line 1: field 'prompt': missing"
    ):
        load_dataset(path, on_error="skip")


def test_parquet_row_errors_and_missing_column(tmp_path):
    rows = [dict(ROWS[0]), dict(ROWS[1], question=None), dict(ROWS[2])]
    path = write_parquet(tmp_path / "d.parquet", rows)
    with pytest.raises(DataError, match=r"d\.parquet:row 2: field 'question': is null") as err:
        load_dataset(path, **MAPPING)
    assert (err.value.line, err.value.field) == (2, "question")
    ds = load_dataset(path, on_error="skip", **MAPPING)
    assert [p.label for p in ds] == [2, 6] and ds.skipped == 1

    # A mapped column the schema lacks is a configuration error: raised even when skipping.
    with pytest.raises(DataError, match=r"field 'answr': no such column \(did you mean 'answer'\?\)") as err:
        load_dataset(path, prompt_key="question", label_key="answr", on_error="skip")
    assert err.value.field == "answr"


def test_hf_row_error_names_row(tmp_path):
    import datasets

    datasets.Dataset.from_list([ROWS[0], dict(ROWS[1], answer=None)]).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(DataError, match=r"hf:row 2: field 'answer': is null"):
        load_dataset(tmp_path / "hf", **MAPPING)


def test_not_a_parquet_file(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_text("hello")
    with pytest.raises(DataError, match=r"d\.parquet: not a readable parquet file"):
        load_dataset(path)


def test_argument_errors(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataError, match="no such file"):
        load_dataset(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match=r"cannot infer the format from suffix '\.txt'"):
        load_dataset(write_jsonl(tmp_path / "d.txt", ROWS))
    assert len(load_dataset(tmp_path / "d.txt", format="jsonl", **MAPPING)) == 3
    with pytest.raises(ValueError, match="not both"):
        load_dataset(path, prompt_key="question", messages_key="messages")
    with pytest.raises(ValueError, match="on_error"):
        load_dataset(path, on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="split='test' applies to format 'hf' only"):
        load_dataset(path, split="test")
    with pytest.raises(ValueError, match="format must be one of"):
        load_dataset(path, format="csv")
