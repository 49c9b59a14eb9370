"""The TITO session store: per session, the exact token ids of each trajectory, and how a request maps onto them.

A black-box agent harness only speaks the OpenAI chat API, and sends the whole
conversation back every turn. Re-tokenising that conversation for training would
train on tokens the model never produced (a decode/re-encode round trip is not the
identity: a different BPE split, a re-serialised tool call, a stripped space). The
store instead keeps, per trajectory, the exact token ids the engine saw and
produced, and on each turn tokenises *only the messages the agent appended*
(`chat.suffix_ids`); earlier model output is never re-tokenised.

Matching a request to a trajectory (messages compared by role, content and tool
calls — ids, spacing of argument JSON and `None` vs `""` do not matter):

- the request extends a trajectory's whole history -> append to that Sample;
- it extends a trajectory only up to an earlier model turn (a retry, or an agent that
  rewound) -> a *branch*: a new Sample holding the shared tokens, then the new turn;
- it shares no model turn with any trajectory -> a new Sample from its messages.

If the agent sends back one of the model's replies *changed* (edited, summarised,
re-formatted beyond the comparison above), the recorded history no longer matches
what the client claims: that is a template mismatch. The request is served on a
branch (so the engine sees what the client sent), `metadata["template_mismatch"]` is
set on that Sample and the `template_mismatches` counter goes up.

Sessions are bounded: one idle for `ttl_s` (default an hour; a turn in progress is never
idle) expires, and its id then gets a 404 saying so; at most `max_sessions` (default
10,000) are open at once, and creating one more is refused (429) naming the cap. An agent
harness that crashes without ending its sessions thus cannot grow the store for ever.

The store knows nothing of HTTP or the engine: `session_server.py` parses requests,
calls the engine between `open_turn` and `close_turn`, and serves the routes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from furlong.core.sample import Sample
from furlong.data.chat import append_runs, encode_prompt, suffix_ids

DEFAULT_TTL_S = 3600.0  # a session idle this long expires
DEFAULT_MAX_SESSIONS = 10_000  # open sessions at most
_EXPIRED_KEPT = 4096  # ids of recently expired sessions, remembered for a clear 404

# the sampling defaults a session may carry: request field -> engine sampling param
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
}


class RequestError(ValueError):
    """A request the session server refuses; `param` names the field, `status` the HTTP status."""

    def __init__(self, param: str, message: str, status: int = 400, code: str | None = None):
        super().__init__(f"{param}: {message}")
        self.param, self.status, self.code = param, status, code


def normalise(m: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a message in a history: role, content, and tool calls (name, decoded arguments)."""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for c in m.get("tool_calls") or []:
        f = c.get("function", c)
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        calls.append((f.get("name"), json.dumps(args, sort_keys=True)))
    return (m.get("role"), (content or "").strip(), tuple(calls))


def template_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools as a session hands them to the chat template: each OpenAI `{"type": "function", "function": f}` as `f`.

    Warm-up demonstrations meant for session rollouts render their tools the same way
    (`calculator.write_demonstrations`), so their prompts are the rollout's token for token.
    """
    return [t.get("function", t) for t in tools]


def clean(m: dict[str, Any]) -> dict[str, Any]:
    """A client message as the chat template reads it (content as text, null fields dropped)."""
    keep = ("role", "content", "tool_calls", "tool_call_id", "name")
    out = {k: v for k, v in m.items() if v is not None and k in keep}
    if isinstance(out.get("content"), list):
        out["content"] = "".join(p.get("text", "") for p in out["content"] if isinstance(p, dict))
    return out


@dataclass
class Trajectory:
    sample: Sample
    tools: list[dict[str, Any]] | None
    history: list[tuple[Any, ...]] = field(default_factory=list)  # normalised messages, replies included
    points: list[tuple[int, int, str]] = field(default_factory=list)  # after each reply: (messages, tokens, its text)
    prompts: list[tuple[int, int]] = field(default_factory=list)  # each turn's prompt: (messages, tokens)


@dataclass
class Session:
    id: str
    metadata: dict[str, Any]
    label: Any = None
    sampling: dict[str, Any] = field(default_factory=dict)  # defaults for what a request leaves out
    budget: int | None = None  # response tokens per trajectory, appended messages included
    turns: int = 0
    trajectories: list[Trajectory] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = 0.0  # the store's clock, at the last request that named the session


@dataclass
class Turn:
    """A chat turn in progress: the trajectory it extends, and what `undo_turn` needs to take it back."""

    traj: Trajectory
    existing: int  # trajectories before the turn: one with a higher index was created for it
    undo: tuple[int, int, int]  # lengths of tokens, history and messages before the turn

    @property
    def sample(self) -> Sample:
        return self.traj.sample


class SessionStore:
    """The open sessions, their trajectories and counters; see the module docstring.

    `ttl_s` None: sessions never expire; `max_sessions` None: no cap. `clock` (seconds,
    monotonic) is what idleness is measured with.
    """

    def __init__(
        self,
        ttl_s: float | None = DEFAULT_TTL_S,
        max_sessions: int | None = DEFAULT_MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"session_ttl_s: must be > 0 (or None: never expire), got {ttl_s!r}")
        if max_sessions is not None and (isinstance(max_sessions, bool) or max_sessions < 1):
            raise ValueError(f"max_sessions: must be >= 1 (or None: no cap), got {max_sessions!r}")
        self.ttl_s, self.max_sessions, self.clock = ttl_s, max_sessions, clock
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.expired: OrderedDict[str, None] = OrderedDict()
        self.counts: Counter[str] = Counter()

    def create(
        self,
        metadata: dict[str, Any] | None = None,
        label: Any = None,
        *,
        sampling: dict[str, Any] | None = None,
        max_new_tokens: int | None = None,
    ) -> str:
        unknown = sorted(set(sampling or {}) - set(SAMPLING_KEYS.values()))
        if unknown:
            raise RequestError("sampling", f"unknown key(s) {unknown}; known: {sorted(SAMPLING_KEYS.values())}")
        if max_new_tokens is not None and (
            isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1
        ):
            raise RequestError("max_new_tokens", f"must be a positive integer, got {max_new_tokens!r}")
        self.expire()
        if self.max_sessions is not None and len(self.sessions) >= self.max_sessions:
            self.counts["sessions_refused"] += 1
            raise RequestError(
                "sessions",
                f"{len(self.sessions)} sessions are open, the cap (max_sessions={self.max_sessions}); "
                "end finished ones with DELETE /sessions/{id}, or wait for idle ones to expire",
                429,
            )
        sid = uuid.uuid4().hex
        session = Session(sid, dict(metadata or {}), label, dict(sampling or {}), max_new_tokens)
        session.last_used = self.clock()
        self.sessions[sid] = session
        self.counts["sessions_created"] += 1
        return sid

    def get(self, sid: str) -> Session:
        """The open session `sid`, now marked used; RequestError 404 naming it if it is unknown or expired."""
        self.expire()
        session = self.sessions.get(sid)
        if session is None:
            if sid in self.expired:
                raise RequestError(
                    "session",
                    f"session {sid!r} expired after {self.ttl_s:g} s idle (create a new one with POST /sessions)",
                    404,
                )
            raise RequestError("session", f"no session {sid!r} (create one with POST /sessions)", 404)
        self.touch(session)
        return session

    def touch(self, session: Session) -> None:
        """Mark `session` used now (it moves to the back of the expiry order)."""
        session.last_used = self.clock()
        if session.id in self.sessions:
            self.sessions.move_to_end(session.id)

    def expire(self) -> int:
        """End every session idle for `ttl_s` (never one with a turn in progress); how many ended."""
        if self.ttl_s is None:
            return 0
        cutoff, gone = self.clock() - self.ttl_s, []
        for sid, session in self.sessions.items():  # least recently used first: stop at the first fresh one
            if session.last_used > cutoff:
                break
            if not session.lock.locked():
                gone.append(sid)
        for sid in gone:
            del self.sessions[sid]
            self.expired[sid] = None
        while len(self.expired) > _EXPIRED_KEPT:
            self.expired.popitem(last=False)
        if gone:
            self.counts["sessions_expired"] += len(gone)
        return len(gone)

    def samples(self, sid: str) -> list[Sample]:
        return [t.sample for t in self.get(sid).trajectories]

    def delete(self, sid: str) -> list[Sample]:
        out = self.samples(sid)
        del self.sessions[sid]
        return out

    def stats(self) -> dict[str, int]:
        self.expire()
        return {**self.counts, "sessions_open": len(self.sessions)}

    # ---- one turn: open (place it, append the new messages), then close or undo -------
    def open_turn(self, session: Session, messages: list[dict[str, Any]], tools: Any, tok: Any) -> Turn:
        """Place a request on a trajectory and append the messages it adds; the sample is then the next prompt."""
        existing = len(session.trajectories)
        traj, new, after = self._place(session, messages, tools, tok)
        sample = traj.sample
        turn = Turn(traj, existing, (len(sample.tokens), len(traj.history), len(sample.metadata["messages"])))
        try:
            if new:
                ids, sources = suffix_ids(tok, [clean(m) for m in new], tools=tools, after_output=after)
                append_runs(sample, ids, sources)
                traj.history.extend(normalise(m) for m in new)
                sample.metadata["messages"].extend(clean(m) for m in new)
        except BaseException:
            self.undo_turn(session, turn)
            raise
        return turn

    def undo_turn(self, session: Session, turn: Turn, *, budget_exhausted: bool = False) -> None:
        """The turn did not happen: leave the trajectory as it was (and drop it if made for this turn)."""
        traj, sample = turn.traj, turn.sample
        if sample.index >= turn.existing:  # created for this turn
            session.trajectories.remove(traj)
        _truncate(sample, turn.undo[0])
        del traj.history[turn.undo[1] :], sample.metadata["messages"][turn.undo[2] :]
        if budget_exhausted:
            sample.metadata["budget_exhausted"] = True
        self.touch(session)

    def close_turn(self, session: Session, turn: Turn, message: dict[str, Any], reply_ids: list[int], tok: Any) -> None:
        """Record the model's reply (already appended to the sample's tokens) as the trajectory's latest turn."""
        traj, sample = turn.traj, turn.sample
        traj.history.append(normalise(message))
        sample.metadata["messages"].append(clean(message))
        traj.points.append((len(traj.history), len(sample.tokens), tok.decode(reply_ids, skip_special_tokens=False)))
        traj.prompts.append((len(traj.history) - 1, len(sample.tokens) - len(reply_ids)))
        sample.metadata["turns"] = len(traj.points)
        session.turns += 1
        sample.metadata["last_turn"] = session.turns
        self.counts["turns"] += 1
        self.touch(session)  # a long turn is activity: the idle time starts when it ends

    def served_prompt(self, session: Session | None, keys: list[tuple[Any, ...]], tools: Any) -> list[int] | None:
        """The ids the latest turn whose prompt is `keys` sent to the engine (in `session`, else any open one)."""
        best: tuple[int, list[int] | None] = (-1, None)
        for s in [session] if session else list(self.sessions.values()):
            for traj in s.trajectories:
                last = traj.sample.metadata.get("last_turn", 0)
                if traj.tools != tools or last <= best[0]:
                    continue
                for n_messages, n_tokens in traj.prompts:
                    if n_messages == len(keys) and traj.history[:n_messages] == keys:
                        best = (last, traj.sample.tokens[:n_tokens])
        return None if best[1] is None else list(best[1])

    def _place(
        self, session: Session, messages: list[dict[str, Any]], tools: Any, tok: Any
    ) -> tuple[Trajectory, list[dict[str, Any]], str | None]:
        """(trajectory to continue, messages to append, text of the reply they follow); see the module docstring.

        The trajectory is the one sharing the longest history with the request up to
        one of the model's replies; its tokens up to that reply are reused as they are.
        """
        keys = [normalise(m) for m in messages]
        best: tuple[int, Trajectory | None, int] = (0, None, -1)  # (messages shared, trajectory, point index)
        mismatch = False
        for traj in session.trajectories:
            if traj.tools != tools:
                continue
            common = next(
                (i for i, (a, b) in enumerate(zip(keys, traj.history)) if a != b), min(len(keys), len(traj.history))
            )
            replies = {m - 1 for m, _, _ in traj.points}  # where the model's own replies sit in the history
            if common in replies and common < len(keys) and keys[common][0] == "assistant":
                mismatch = True  # the client sent back one of the model's replies changed
            for k, (m, _, _) in enumerate(traj.points):
                if best[0] < m <= common and m < len(keys):
                    best = (m, traj, k)
        if mismatch:
            self.counts["template_mismatches"] += 1
        shared, parent, k = best
        if parent is not None and shared == len(parent.history):
            return parent, messages[shared:], parent.points[k][2]
        if parent is not None:  # a branch at an earlier reply: the shared tokens are kept as they are
            m, t, after = parent.points[k]
            sample = _truncate(Sample.from_dict(json.loads(parent.sample.to_json())), t)
            traj = self._new_trajectory(
                session,
                sample,
                tools,
                parent.sample.metadata["messages"][:m],
                branch_of=session.trajectories.index(parent),
            )
            traj.history = parent.history[:m]
            traj.points, traj.prompts = parent.points[: k + 1], parent.prompts[: k + 1]
        else:
            prompt = [clean(m) for m in messages]
            sample = Sample(prompt=prompt, tokens=encode_prompt(tok, prompt, tools), label=session.label)
            traj = self._new_trajectory(session, sample, tools, list(prompt), branch_of=None)
            traj.history, shared, after = keys, len(messages), None
        if len(session.trajectories) > 1:
            self.counts["branches"] += 1
        traj.sample.metadata["template_mismatch"] = mismatch
        return traj, messages[shared:], after

    def _new_trajectory(
        self, session: Session, sample: Sample, tools: Any, messages: list[dict[str, Any]], branch_of: int | None
    ) -> Trajectory:
        sample.index = len(session.trajectories)
        sample.metadata = {
            **session.metadata,
            "session_id": session.id,
            "trajectory": sample.index,
            "branch_of": branch_of,
            "tools": tools,
            "messages": list(messages),
            "turns": 0,
        }
        traj = Trajectory(sample, tools)
        session.trajectories.append(traj)
        return traj


def _truncate(sample: Sample, n_tokens: int) -> Sample:
    """Cut `sample` in place after its first `n_tokens` tokens (per-token data cut alike)."""
    r = n_tokens - sample.prompt_length
    del sample.tokens[n_tokens:]
    for per_token in (sample.loss_mask, sample.rollout_logprobs, sample.token_versions, sample.token_sources):
        del per_token[r:]
    sample.response_length = r
    sample.reward, sample.teacher_logprobs, sample.routed_experts = None, None, None
    return sample
