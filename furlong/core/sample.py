"""The Sample: one trajectory, the unit every stage of furlong passes along.

A Sample carries everything the trainer needs without re-tokenising anything
(token-in-token-out): the exact ids the engine produced, their log-probs, which
weight version produced each token and where each token came from. `validate()`
checks every length invariant so a broken producer is caught where it breaks,
not three stages later as a shape error inside the loss.
"""

from __future__ import annotations

import base64
import json
import math
import sys
from array import array
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any


class Status(str, Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


class Source(str, Enum):
    """Where a response token came from; only `policy` tokens are trained by default."""

    POLICY = "policy"
    TOOL = "tool"
    ENV = "env"
    TEMPLATE = "template"


class SampleError(ValueError):
    """A Sample that breaks an invariant; the message names the field."""


@dataclass
class Sample:
    index: int = 0
    group_index: int = 0
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)  # prompt + response ids
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)  # per response token: 1 trained, 0 not
    rollout_logprobs: list[float] = field(default_factory=list)  # per response token
    token_versions: list[int] = field(default_factory=list)  # weight version per response token
    token_sources: list[str] = field(default_factory=list)  # Source value per response token
    reward: float | dict[str, float] | None = None
    status: Status = Status.PENDING
    status_reason: str = ""
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    teacher_logprobs: list[float] | None = None
    routed_experts: dict[str, Any] | None = None  # R3: `encode_routes` form; a route per token but the last

    # ---- derived views -------------------------------------------------
    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    @property
    def scalar_reward(self) -> float:
        """The reward the advantage estimators use: a float, or the `score` key of a dict."""
        if self.reward is None:
            raise SampleError(f"sample {self.index}: reward is not set")
        if isinstance(self.reward, dict):
            if "score" not in self.reward:
                raise SampleError(f"sample {self.index}: reward dict has no 'score' key: {sorted(self.reward)}")
            return float(self.reward["score"])
        return float(self.reward)

    def oldest_version(self) -> int | None:
        """Weight version of the oldest policy token: what staleness is measured on."""
        versions = [v for v, s in zip(self.token_versions, self.token_sources) if s == Source.POLICY.value]
        return min(versions) if versions else None

    # ---- building ------------------------------------------------------
    def append(
        self,
        token_ids: list[int],
        *,
        source: Source | str = Source.POLICY,
        logprobs: list[float] | None = None,
        version: int = -1,
        trained: bool | None = None,
    ) -> None:
        """Append response tokens with their per-token data kept aligned.

        Non-policy tokens (tool output, env observations, template glue) get
        log-prob 0 and loss mask 0 unless `trained` says otherwise.
        """
        source = Source(source).value
        n = len(token_ids)
        if logprobs is not None and len(logprobs) != n:
            raise SampleError(f"append: {n} tokens but {len(logprobs)} logprobs")
        if trained is None:
            trained = source == Source.POLICY.value
        self.tokens.extend(int(t) for t in token_ids)
        self.response_length += n
        self.loss_mask.extend([int(trained)] * n)
        self.rollout_logprobs.extend(logprobs if logprobs is not None else [0.0] * n)
        self.token_versions.extend([int(version)] * n)
        self.token_sources.extend([source] * n)

    # ---- checking ------------------------------------------------------
    def validate(self) -> Sample:
        """Raise SampleError naming the first field that breaks an invariant."""
        r = self.response_length
        if r < 0 or r > len(self.tokens):
            raise SampleError(f"sample {self.index}: response_length={r} but len(tokens)={len(self.tokens)}")
        per_token = {
            "loss_mask": self.loss_mask,
            "rollout_logprobs": self.rollout_logprobs,
            "token_versions": self.token_versions,
            "token_sources": self.token_sources,
        }
        if self.teacher_logprobs is not None:
            per_token["teacher_logprobs"] = self.teacher_logprobs
        for name, values in per_token.items():
            if len(values) != r:
                raise SampleError(f"sample {self.index}: len({name})={len(values)} != response_length={r}")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise SampleError(f"sample {self.index}: loss_mask must hold only 0 and 1")
        valid_sources = {s.value for s in Source}
        bad = [s for s in self.token_sources if s not in valid_sources]
        if bad:
            raise SampleError(f"sample {self.index}: token_sources has unknown value {bad[0]!r}")
        if any(not math.isfinite(x) or x > 1e-6 for x in self.rollout_logprobs):
            raise SampleError(f"sample {self.index}: rollout_logprobs must be finite and <= 0")
        if any(t < 0 for t in self.tokens):
            raise SampleError(f"sample {self.index}: tokens holds a negative id")
        if self.routed_experts is not None:
            shape = decode_routes(self.routed_experts, f"sample {self.index}: routed_experts")[0]
            if shape[0] > len(self.tokens) - 1:  # fewer is fine: tokens appended since route afresh in training
                raise SampleError(
                    f"sample {self.index}: routed_experts covers {shape[0]} positions, more than len(tokens) - 1 = "
                    f"{len(self.tokens) - 1} (every token but the last, which no forward has consumed)"
                )
        Status(self.status)
        return self

    # ---- serialisation -------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = Status(self.status).value
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise SampleError(f"Sample.from_dict: unknown field(s) {unknown}")
        s = cls(**d)
        s.status = Status(s.status)
        return s

    @classmethod
    def from_json(cls, text: str) -> Sample:
        return cls.from_dict(json.loads(text))


# ---- R3 routes ----------------------------------------------------------
# Expert ids stored one small int each (base64 in JSON): uint8 when every id is below 255, else int16.
# The dtype's largest value marks a position the engine did not record (the trainer routes it afresh).
ROUTE_DTYPES = {"uint8": ("B", 255), "int16": ("h", 32767)}  # array typecode, the "no route" id


def encode_routes(routes: list[list[list[int]] | None]) -> dict[str, Any]:
    """`[position][layer][k]` expert ids (a position may be None) -> the compact form `Sample.routed_experts` holds.

    `{"dtype", "shape": [positions, layers, k], "data": base64}`: one byte per id where a JSON list takes
    about three characters and a comma; a sample stays readable JSON and round-trips exactly.
    """
    known = [r for r in routes if r is not None]
    layers, k = (len(known[0]), len(known[0][0])) if known and known[0] else (0, 0)
    top = max((e for r in known for layer in r for e in layer), default=0)
    dtype = "uint8" if top < ROUTE_DTYPES["uint8"][1] else "int16"
    code, missing = ROUTE_DTYPES[dtype]
    flat = array(code)
    for p, r in enumerate(routes):
        if r is None:
            flat.extend([missing] * (layers * k))
            continue
        if len(r) != layers or any(len(ids) != k for ids in r):
            raise SampleError(f"routed_experts: position {p} is not [{layers} layers][{k}] ids")
        for ids in r:
            flat.extend(ids)
    if sys.byteorder == "big":  # stored little-endian
        flat.byteswap()
    return {"dtype": dtype, "shape": [len(routes), layers, k], "data": base64.b64encode(flat.tobytes()).decode()}


def decode_routes(blob: dict[str, Any], where: str = "routed_experts") -> tuple[list[int], array]:
    """(shape, the flat little-endian ids) of an `encode_routes` blob; raises SampleError naming `where`."""
    try:
        code, _ = ROUTE_DTYPES[blob["dtype"]]
        shape = [int(n) for n in blob["shape"]]
        flat = array(code, base64.b64decode(blob["data"], validate=True))
    except (KeyError, TypeError, ValueError) as e:  # binascii.Error is a ValueError
        raise SampleError(f"{where}: not an encode_routes blob ({type(e).__name__}: {e})") from None
    if len(shape) != 3 or len(flat) != shape[0] * shape[1] * shape[2]:
        raise SampleError(f"{where}: shape {shape} does not match {len(flat)} stored ids")
    if sys.byteorder == "big":
        flat.byteswap()
    return shape, flat


def routes_as_lists(blob: dict[str, Any]) -> list[list[list[int]] | None]:
    """The `[position][layer][k]` lists (None: not recorded) an `encode_routes` blob holds."""
    (n, layers, k), flat = decode_routes(blob)
    missing = ROUTE_DTYPES[blob["dtype"]][1]
    out: list[list[list[int]] | None] = []
    for p in range(n):
        row = flat[p * layers * k : (p + 1) * layers * k]
        out.append(None if layers and row[0] == missing else [list(row[i * k : (i + 1) * k]) for i in range(layers)])
    return out
