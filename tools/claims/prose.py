"""Claims in prose: a sentence may not promise more than `docs/features.yaml` says.

Tables and counts are checked elsewhere; this reads the *sentences* of README.md and docs/**/*.md
(outside code blocks, tables, headings and the generated reference pages) and, per sentence, finds

- the features it names: a feature's name (up to its parenthesis) or one of `ALIASES[id]`;
- the status it claims: `working` / `works` / `supported` / `production-ready` need status
  `working`; `tested` / `proven` need `working` or `partial` (a partial feature's listed tests
  pass too); nothing may be claimed of a `planned` feature;
- a device claim: "runs on CUDA", "on GPUs", "CUDA devices", ... The manifest records no GPU
  evidence (no test here ran on a GPU), so such a sentence must say so (`HEDGES`: untested,
  not tested, written for, no GPU, ...), whatever the feature.

`LIMITS` caps claims about parts of a feature that its tests do not prove (E2B and Daytona are
tested against local fakes of their APIs): a status word next to them is an overclaim unless
the live test named there passed in the JUnit report.

A negated or hedged sentence ("not yet supported", "untested on a GPU") claims nothing. A sentence
that should be exempt can carry `<!-- claims:ok -->` on its line, which a reviewer sees in the diff.
"""

from __future__ import annotations

import re
from pathlib import Path

from tools.claims import Problem
from tools.claims.evidence import Case, outcome
from tools.claims.manifest import BEGIN, END, MANIFEST, Feature
from tools.claims.markdown_scan import prose_lines

RANK = {"planned": 0, "partial": 1, "working": 2}
CLAIMS = {  # status word -> the least manifest status that backs it
    r"\bworking\b": "working",
    r"\bworks\b": "working",
    r"\bfully supported\b": "working",
    r"\bsupported\b": "working",
    r"\bproduction[- ]ready\b": "working",
    r"\btested\b": "partial",
    r"\bproven\b": "partial",
}
DEVICE = re.compile(
    r"\bruns? on (?:a |the |any |one |several |\d+ )?(?:CUDA|GPUs?|H100s?|A100s?)\b|\bCUDA devices?\b"
    r"|\bon (?:the |a |one |several )?GPUs?\b(?! (?:figure|number|machine)s?\b)",
    re.IGNORECASE,
)
HEDGES = re.compile(
    r"\b(?:not|no|never|untested|unverified|unmeasured|without|planned|yet|once|until|would|should|could|may|might"
    r"|can't|cannot|isn't|aren't|written for|intended|skipped|only when|if|needs?|requires?)\b",
    re.IGNORECASE,
)
ALIASES = {  # extra names a sentence may use for a feature (the manifest name, up to "(", always counts)
    "sglang": ["SGLang"],
    "low-precision": ["FP8", "MXFP8", "NVFP4", "INT4 QAT", "QAT"],
    "lora": ["LoRA", "multi-LoRA"],
    "r3": ["R3", "routing replay"],
    "ray": ["scale-out", "multi-node"],
    "plug-points": ["plug points"],
    "tito": ["TITO"],
    "dashboard": ["dashboard"],
}
LIMITS = {  # a part of a feature its tests do not prove: cap, and the test that would lift the cap
    "E2B": ("partial", "tested against a local fake of its API", "tests/integration/test_sandbox_providers_live.py"),
    "Daytona": (
        "partial",
        "tested against a local fake of its API",
        "tests/integration/test_sandbox_providers_live.py",
    ),
}
EXEMPT = "<!-- claims:ok -->"


def sentences(text: str) -> list[tuple[int, str]]:
    """(line, sentence) of the prose: paragraphs joined, code, tables, headings and the feature table left out."""
    lines = prose_lines(text)
    raw = text.splitlines()
    out: list[tuple[int, str]] = []
    para: list[tuple[int, str]] = []
    in_table = False

    def flush() -> None:
        if not para:
            return
        joined, starts, pos = "", [], 0
        for n, line in para:
            starts.append((pos, n))
            joined += line.strip() + " "
            pos = len(joined)
        for m in re.finditer(r"[^.!?]+(?:[.!?]+(?=\s|$)|$)", joined):
            s = m.group(0).strip()
            if s:
                first = m.start() + len(m.group(0)) - len(m.group(0).lstrip())
                line_no = max(n for p, n in starts if p <= first)
                out.append((line_no, s))
        para.clear()

    for n, line in lines:
        original = raw[n - 1]
        if BEGIN in original:
            in_table = True
        if END in original:
            in_table = False
            flush()
            continue
        stripped = line.strip()
        if in_table or not stripped or stripped.startswith(("|", "#", "<!--", "---")) or EXEMPT in original:
            flush()
            continue
        if re.match(r"^([-*+]|\d+\.)\s", stripped):  # a list item starts a sentence of its own
            flush()
        para.append((n, re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", stripped)))  # link text only
    flush()
    return out


def _names(f: Feature) -> list[str]:
    base = f.name.split("(")[0].replace("`", "").strip()
    return [base, *ALIASES.get(f.id, [])] if len(base) > 3 else ALIASES.get(f.id, [])


def _mentions(sentence: str, name: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", sentence, re.IGNORECASE) is not None


def check_prose(
    root: Path, features: list[Feature], files: list[Path], cases: list[Case] | None = None
) -> list[Problem]:
    """Every sentence that claims more than the manifest (or `LIMITS`, or the missing GPU evidence) allows."""
    problems: list[Problem] = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        if rel.startswith("docs/reference/"):
            continue  # generated from the code
        for line, s in sentences(path.read_text(encoding="utf-8")):
            hedged = HEDGES.search(s) is not None
            if DEVICE.search(s) and not hedged:
                problems.append(
                    Problem(
                        rel,
                        line,
                        f"claims GPU operation ({DEVICE.search(s).group(0)!r}) but no test here ran "
                        f"on a GPU: say it is untested on a GPU, or mark the sentence {EXEMPT}",
                    )
                )
            claimed = [need for pattern, need in CLAIMS.items() if re.search(pattern, s, re.IGNORECASE)]
            if not claimed or hedged:
                continue
            need = max(claimed, key=RANK.__getitem__)
            for f in features:
                name = next((n for n in _names(f) if _mentions(s, n)), None)
                if name is not None and f.status in RANK and RANK[f.status] < RANK[need]:
                    problems.append(
                        Problem(
                            rel,
                            line,
                            f"claims {name!r} is {need}-level but {MANIFEST}:{f.at('status')} "
                            f"says {f.id} is {f.status!r}",
                        )
                    )
            for name, (cap, why, test) in LIMITS.items():
                proven = cases is not None and outcome(cases, test) == "passed"
                if _mentions(s, name) and RANK[cap] < RANK[need] and not proven:
                    problems.append(
                        Problem(
                            rel,
                            line,
                            f"claims {name!r} is {need}-level but it is only {why}; "
                            f"{test} has not passed (it needs the provider's API key)",
                        )
                    )
    return problems
