"""Read-only queries over a run's `events.sqlite`, shaped for the dashboard's JSON API.

Every answer is plain JSON (no NaN: non-finite numbers become null). A run
directory in any state gets an answer, never a crash: no `events.sqlite` yet or a
file whose tables are not created yet gives empty payloads with a `message`; a
file that is not SQLite raises `RunError(422)`; a missing directory
`RunError(404)`. Each call opens its own read-only connection, so a dashboard
reading a live run never blocks the writers (WAL readers see the last commit).
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from furlong.observe.store import DB_NAME, PACKED, unpack

SORTABLE = (
    "id",
    "step",
    "idx",
    "grp",
    "reward",
    "status",
    "staleness",
    "prompt_length",
    "response_length",
    "trained_tokens",
    "version_min",
)
ENGINE_METRIC = re.compile(r"^engine/([^/]+)/(.+)$")
TABLES = ("spans", "metrics", "samples", "meta")
TEXT_PREVIEW = 160


class RunError(Exception):
    """A run directory the dashboard cannot read; `status` is the HTTP status to answer with (always 4xx)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def finite(x: Any) -> Any:
    """x with every non-finite float (also inside lists) replaced by None, so it is valid JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, list):
        return [finite(v) for v in x]
    return x


class RunReader:
    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / DB_NAME
        if not self.run_dir.is_dir():
            raise RunError(404, f"run directory {self.run_dir} does not exist")

    # ---------------------------------------------------------------- plumbing
    @contextmanager
    def _db(self) -> Iterator[tuple[sqlite3.Connection | None, set[str]]]:
        """(connection, tables present); (None, empty) when there is no event store yet."""
        if not self.path.is_file():
            yield None, set()
            return
        try:
            conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5.0)
        except sqlite3.Error as e:
            raise RunError(422, f"{self.path}: cannot open the event store: {e}") from e
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            yield conn, tables & set(TABLES)
        except sqlite3.OperationalError as e:
            if "locked" in str(e) or "busy" in str(e):
                raise RunError(409, f"{self.path} is busy (a writer holds it); retry: {e}") from e
            raise RunError(422, f"{self.path} cannot be read ({e}): is it a furlong event store?") from e
        except sqlite3.DatabaseError as e:
            raise RunError(422, f"{self.path} is not a readable SQLite event store ({e})") from e
        finally:
            conn.close()

    def _empty_message(self, tables: set[str], need: str) -> str | None:
        if not self.path.is_file():
            return f"no {DB_NAME} in {self.run_dir} yet: the run has not recorded anything"
        if need not in tables:
            return f"{DB_NAME} has no {need} table yet: the run is starting"
        return None

    # ---------------------------------------------------------------- summary
    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "run": self.run_dir.name,
            "run_dir": str(self.run_dir),
            "has_store": self.path.is_file(),
            "steps": [],
            "workers": [],
            "counts": {t: 0 for t in ("spans", "metrics", "samples")},
            "first_time": None,
            "last_time": None,
            "dropped_events": 0,
            "message": None,
        }
        cfg = self.run_dir / "config.yaml"
        out["config"] = cfg.read_text(errors="replace")[:20000] if cfg.is_file() else None
        with self._db() as (db, tables):
            out["message"] = self._empty_message(tables, "spans")
            if db is None:
                return out
            steps: set[int] = set()
            times: list[float] = []
            for t, time_cols in (
                ("spans", "MIN(start), MAX(end)"),
                ("metrics", "MIN(time), MAX(time)"),
                ("samples", "MIN(time), MAX(time)"),
            ):
                if t in tables:
                    out["counts"][t] = db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                    steps |= {r[0] for r in db.execute(f"SELECT DISTINCT step FROM {t} WHERE step IS NOT NULL")}
                    times += [x for x in db.execute(f"SELECT {time_cols} FROM {t}").fetchone() if x is not None]
            if "spans" in tables:
                out["workers"] = sorted((r[0] for r in db.execute("SELECT DISTINCT worker FROM spans")), key=_natural)
            if "meta" in tables:
                out["dropped_events"] = sum(
                    int(r[0]) for r in db.execute("SELECT value FROM meta WHERE key LIKE 'dropped_events:%'")
                )
            out["steps"] = sorted(steps)
            out["first_time"], out["last_time"] = (min(times), max(times)) if times else (None, None)
        return out

    # ---------------------------------------------------------------- metrics
    def metrics(self, names: list[str] | None = None) -> dict[str, Any]:
        """{name: [[step, value], ...]}: the last value recorded per (name, step), plus per-step sample aggregates."""
        series: dict[str, list[list[Any]]] = defaultdict(list)
        with self._db() as (db, tables):
            message = self._empty_message(tables, "metrics")
            if "metrics" in tables:
                rows = db.execute(
                    "SELECT name, step, value FROM metrics WHERE id IN (SELECT MAX(id) FROM metrics GROUP BY name, step)"
                    " ORDER BY name, step"
                )
                for name, step, value in rows:
                    series[name].append([step, finite(value)])
            if "samples" in tables:
                agg = db.execute(
                    "SELECT step, AVG(reward), AVG(response_length), AVG(status='truncated'), AVG(status='aborted'),"
                    " AVG(staleness), COUNT(*) FROM samples GROUP BY step ORDER BY step"
                )
                keys = (
                    "reward_mean",
                    "response_length_mean",
                    "truncated_frac",
                    "aborted_frac",
                    "staleness_mean",
                    "count",
                )
                for step, *vals in agg:
                    for k, v in zip(keys, vals):
                        series[f"samples/{k}"].append([step, finite(float(v)) if v is not None else None])
        if names:
            series = {k: v for k, v in series.items() if k in names}
        return {"series": dict(series), "names": sorted(series), "message": message if not series else None}

    def engines(self) -> dict[str, Any]:
        """Per engine (from metrics named `engine/<id>/<field>`): latest value and series of every field."""
        found: dict[str, dict[str, Any]] = {}
        for name, points in self.metrics()["series"].items():
            m = ENGINE_METRIC.match(name)
            if not m:
                continue
            e = found.setdefault(m.group(1), {"id": m.group(1), "latest": {}, "series": {}})
            e["series"][m.group(2)] = points
            e["latest"][m.group(2)] = points[-1][1] if points else None
        engines = sorted(found.values(), key=lambda e: _natural(e["id"]))
        for e in engines:
            h = e["latest"].get("healthy")
            e["healthy"] = None if h is None else bool(h)
        msg = (
            None
            if engines
            else "no engine metrics recorded (names like engine/<id>/queue, engine/<id>/tokens_per_s, engine/<id>/healthy)"
        )
        return {"engines": engines, "message": msg}

    # ---------------------------------------------------------------- timeline
    def timeline(self, step_from: int | None = None, step_to: int | None = None, limit: int = 20000) -> dict[str, Any]:
        """One lane per worker with its spans; the newest `limit` spans when there are more."""
        where, args = [], []
        if step_from is not None:
            where.append("step >= ?"), args.append(step_from)
        if step_to is not None:
            where.append("step <= ?"), args.append(step_to)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        out: dict[str, Any] = {"lanes": [], "steps": [], "t0": None, "t1": None, "truncated": False}
        with self._db() as (db, tables):
            out["message"] = self._empty_message(tables, "spans")
            if "spans" not in tables:
                return out
            total = db.execute(f"SELECT COUNT(*) FROM spans {clause}", args).fetchone()[0]
            rows = db.execute(
                f"SELECT worker, device, phase, step, start, end, attrs FROM"
                f" (SELECT * FROM spans {clause} ORDER BY start DESC LIMIT ?) ORDER BY start",
                [*args, limit],
            ).fetchall()
        out["truncated"] = total > len(rows)
        if out["truncated"]:
            out["message"] = f"showing the newest {len(rows)} of {total} spans; pick a step range to see the rest"
        lanes: dict[str, dict[str, Any]] = {}
        steps: dict[int, list[float]] = {}
        for worker, device, phase, step, start, end, attrs in rows:
            lane = lanes.setdefault(worker, {"worker": worker, "devices": [], "spans": []})
            if device and device not in lane["devices"]:
                lane["devices"].append(device)
            lane["spans"].append(
                {
                    "phase": phase,
                    "step": step,
                    "start": start,
                    "end": end,
                    "attrs": json.loads(attrs) if attrs else None,
                }
            )
            if step is not None:
                lo_hi = steps.setdefault(step, [start, end])
                lo_hi[0], lo_hi[1] = min(lo_hi[0], start), max(lo_hi[1], end)
        out["lanes"] = [lanes[w] for w in sorted(lanes, key=_natural)]
        out["steps"] = [{"step": s, "start": a, "end": b} for s, (a, b) in sorted(steps.items())]
        if rows:
            out["t0"], out["t1"] = rows[0][4], max(r[5] for r in rows)
        return out

    # ---------------------------------------------------------------- samples
    def samples(
        self,
        *,
        step: int | None = None,
        status: str | None = None,
        group: int | None = None,
        q: str | None = None,
        sort: str = "id",
        order: str = "asc",
        limit: int = 200,
        offset: int = 0,
    ) -> dict[str, Any]:
        if sort not in SORTABLE:
            raise RunError(400, f"sort={sort!r} is not one of {', '.join(SORTABLE)}")
        if order not in ("asc", "desc"):
            raise RunError(400, f"order={order!r} must be asc or desc")
        where, args = [], []
        for col, val in (("step", step), ("status", status), ("grp", group)):
            if val is not None:
                where.append(f"{col} = ?"), args.append(val)
        if q:
            where.append("(prompt_text LIKE ? OR response_text LIKE ?)"), args.extend([f"%{q}%"] * 2)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        with self._db() as (db, tables):
            message = self._empty_message(tables, "samples")
            if "samples" not in tables:
                return {"total": 0, "rows": [], "statuses": [], "message": message}
            total = db.execute(f"SELECT COUNT(*) FROM samples {clause}", args).fetchone()[0]
            cols = (
                "id",
                "step",
                "idx",
                "grp",
                "reward",
                "status",
                "status_reason",
                "staleness",
                "prompt_length",
                "response_length",
                "trained_tokens",
                "version_min",
                "version_max",
            )
            rows = db.execute(
                f"SELECT {', '.join(cols)}, substr(prompt_text, 1, {TEXT_PREVIEW}), substr(response_text, 1, {TEXT_PREVIEW})"
                f" FROM samples {clause} ORDER BY {sort} {order.upper()} NULLS LAST, id LIMIT ? OFFSET ?",
                [*args, limit, offset],
            ).fetchall()
            statuses = [r[0] for r in db.execute("SELECT DISTINCT status FROM samples ORDER BY status")]
        out = [dict(zip((*cols, "prompt", "response"), map(finite, r))) for r in rows]
        for r in out:
            r["prompt"] = _prompt_preview(r["prompt"])
        return {"total": total, "rows": out, "statuses": statuses, "message": message}

    def groups(self, step: int | None = None) -> dict[str, Any]:
        """Per (step, group): size, reward mean/std/min/max, zero variance, status counts, mean length."""
        clause, args = ("WHERE step = ?", [step]) if step is not None else ("", [])
        with self._db() as (db, tables):
            message = self._empty_message(tables, "samples")
            if "samples" not in tables:
                return {"groups": [], "message": message}
            rows = db.execute(
                f"SELECT step, grp, reward, status, response_length, id FROM samples {clause} ORDER BY step, grp, idx",
                args,
            ).fetchall()
        groups: dict[tuple[int, int], dict[str, Any]] = {}
        for step_, grp, reward, status, length, sid in rows:
            g = groups.setdefault(
                (step_, grp), {"step": step_, "group": grp, "rewards": [], "statuses": {}, "lengths": [], "ids": []}
            )
            g["rewards"].append(reward)
            g["statuses"][status] = g["statuses"].get(status, 0) + 1
            g["lengths"].append(length)
            g["ids"].append(sid)
        out = []
        for g in groups.values():
            r = [x for x in g.pop("rewards") if x is not None]
            lengths = g.pop("lengths")
            mean = sum(r) / len(r) if r else None
            g.update(
                n=len(g["ids"]),
                reward_mean=mean,
                reward_min=min(r) if r else None,
                reward_max=max(r) if r else None,
                reward_std=math.sqrt(sum((x - mean) ** 2 for x in r) / len(r)) if r else None,
                zero_variance=len(r) > 1 and max(r) == min(r),
                length_mean=sum(lengths) / len(lengths),
            )
            out.append(g)
        return {"groups": out, "message": message}

    def sample(self, sample_id: int) -> dict[str, Any]:
        with self._db() as (db, tables):
            if "samples" not in tables:
                raise RunError(404, self._empty_message(tables, "samples") or "no samples")
            db.row_factory = sqlite3.Row
            row = db.execute("SELECT * FROM samples WHERE id = ?", (sample_id,)).fetchone()
            if row is None:
                raise RunError(404, f"no sample with id {sample_id} in {self.path}")
            prev = db.execute("SELECT MAX(id) FROM samples WHERE id < ?", (sample_id,)).fetchone()[0]
            nxt = db.execute("SELECT MIN(id) FROM samples WHERE id > ?", (sample_id,)).fetchone()[0]
        d = {k: finite(row[k]) for k in row.keys()}
        try:
            tokens = json.loads(d.pop("tokens"))
        except (TypeError, ValueError) as e:
            raise RunError(422, f"sample {sample_id}: its per-token data is not valid JSON ({e})") from e
        try:
            tokens.update({k: unpack(tokens.get(k), code) for k, code in PACKED.items()})
        except (TypeError, ValueError) as e:
            raise RunError(422, f"sample {sample_id}: its per-token arrays cannot be decoded ({e})") from e
        d["tokens"] = {k: finite(v) for k, v in tokens.items()}
        d["reward_detail"] = json.loads(d["reward_detail"]) if d["reward_detail"] else None
        d["messages"] = _messages(d["prompt_text"])
        d["prev_id"], d["next_id"] = prev, nxt
        return d


def _messages(prompt: str | None) -> list[dict[str, Any]] | None:
    """The prompt as chat messages when it was recorded as a message list, else None (plain text)."""
    if not prompt or not prompt.startswith("["):
        return None
    try:
        msgs = json.loads(prompt)
    except ValueError:
        return None
    return msgs if isinstance(msgs, list) and all(isinstance(m, dict) for m in msgs) else None


def _prompt_preview(prompt: str | None) -> str | None:
    """The last message's content for a (truncated) message list, else the text itself."""
    if prompt and prompt.startswith("["):
        found = re.findall(r'"content":\s*"((?:[^"\\]|\\.)*)', prompt)
        if found:
            return found[-1]
    return prompt


def _natural(s: str) -> list[Any]:
    """'trainer/10' after 'trainer/2'."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]
