"""Dataset fuzzing: any bytes in a JSONL file give prompts or a DataError naming file and line — nothing else.

Lines are drawn from good records, records with fields missing, wrong types, broken
UTF-8, broken JSON, blank lines and lines over `max_line_bytes`. With `on_error=raise`
the first bad line is reported by number; with `on_error=skip` every good line is kept,
in order, and every bad one counted.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from furlong.data.datasets import DataError, load_dataset

MAX_LINE = 400
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=6,
)
good = st.builds(
    lambda p, lab: {"prompt": p, "label": lab},
    st.text(min_size=1, max_size=30).filter(str.strip),
    json_values.filter(lambda v: v is not None),
)  # a null label is an error by design
dumps = lambda v: json.dumps(v).encode()
bad = st.one_of(
    st.builds(lambda lab: {"label": lab}, json_values).map(dumps),  # prompt missing
    st.builds(
        lambda p: {"prompt": p, "label": 1}, st.integers() | st.lists(st.integers(), max_size=3) | st.just(" ")
    ).map(dumps),
    json_values.filter(lambda v: not isinstance(v, dict)).map(dumps),  # not an object
    st.binary(min_size=1, max_size=40).map(lambda b: b.replace(b"\n", b" ") + b"\xff\xfe"),  # invalid UTF-8
    st.text(min_size=1, max_size=30).map(lambda t: ("{" + t.replace("\n", " ")).encode()),  # broken JSON
    st.just(dumps({"prompt": "x" * MAX_LINE, "label": 1})),  # over max_line_bytes
)
line = st.one_of(good.map(lambda r: ("good", r)), bad.map(lambda r: ("bad", r)), st.just(("blank", b"")))


def encode(item) -> bytes:
    _, value = item
    return value if isinstance(value, bytes) else dumps(value)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(line, max_size=12))
def test_any_jsonl_gives_prompts_or_an_error_naming_the_line(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("fuzz") / "data.jsonl"
    path.write_bytes(b"\n".join(encode(x) for x in lines))
    kinds = [k for k, _ in lines]
    try:
        ds = load_dataset(path, prompt_key="prompt", label_key="label", max_line_bytes=MAX_LINE)
    except DataError as e:
        assert "bad" in kinds or "good" not in kinds, f"good file refused: {e}"
        assert str(path) in str(e)
        if "good" in kinds and e.line is not None:  # reported at the first bad line, by its 1-based number
            assert kinds[e.line - 1] == "bad", (e, kinds)
    else:
        assert "bad" not in kinds and len(ds) == kinds.count("good")
        assert [p.prompt for p in ds] == [v["prompt"] for k, v in lines if k == "good"]

    try:
        ds = load_dataset(path, prompt_key="prompt", label_key="label", max_line_bytes=MAX_LINE, on_error="skip")
    except DataError as e:
        assert "good" not in kinds and "no usable records" in str(e) or not lines
    else:
        assert [p.prompt for p in ds] == [v["prompt"] for k, v in lines if k == "good"]
        assert ds.skipped == kinds.count("bad")
        assert [p.index for p in ds] == list(range(len(ds)))
