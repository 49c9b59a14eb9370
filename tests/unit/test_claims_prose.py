"""Claims in prose: a sentence in the docs or README that promises more than docs/features.yaml fails the check.

The real docs are copied to a temporary tree; one planted overclaim at a time must fail the claims
check (`run_checks`, what `python -m tools.claims` runs) naming its file and line, and the unplanted
copy must pass the prose check.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tools.claims.check import markdown_files, run_checks
from tools.claims.manifest import load
from tools.claims.prose import check_prose, sentences

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("claims")
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copy(ROOT / "README.md", root / "README.md")
    return root


def _prose(root: Path, cases=None) -> list[str]:
    features, _ = load(root)
    return [str(p) for p in check_prose(root, features, markdown_files(root), cases)]


def test_the_real_docs_claim_no_more_than_the_manifest(tree):
    assert _prose(tree) == []


@pytest.mark.parametrize(
    ("sentence", "why"),
    [
        ("The SGLang engine backend is working and supported on every machine.", "sglang is 'partial'"),
        ("The built-in engine runs on CUDA devices as fast as SGLang.", "claims GPU operation"),
    ],
)
def test_a_planted_overclaim_fails_the_claims_check(tree, sentence, why):
    page = tree / "docs" / "engine-router.md"
    original = page.read_text(encoding="utf-8")
    lines = original.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("## ")) + 2  # after a heading and its blank line
    page.write_text("\n".join(lines[:at] + [sentence, ""] + lines[at:]) + "\n", encoding="utf-8")
    try:
        problems = [str(p) for p in run_checks(tree, evidence=False, references=False)]
    finally:
        page.write_text(original, encoding="utf-8")
    hits = [p for p in problems if p.startswith(f"docs/engine-router.md:{at + 1}:")]
    assert len(hits) >= 1 and any(why in h for h in hits), problems


@pytest.mark.parametrize(
    ("sentence", "why"),
    [
        ("E2B and Daytona sandboxes are working for every recipe.", "only tested against a local fake"),
        ("Multi-node runs are fully supported, on every cluster.", "ray is 'partial'"),
        ("- Plug points: tested and production-ready.", "plug-points is 'partial'"),
    ],
)
def test_more_overclaims_the_prose_check_names(tree, sentence, why):
    page = tree / "docs" / "planted.md"
    page.write_text(f"# Planted\n\nAn honest sentence.\n{sentence}\n", encoding="utf-8")
    try:
        found = [p for p in _prose(tree) if p.startswith("docs/planted.md:4:")]
    finally:
        page.unlink()
    assert found and any(why in p for p in found), found


def test_hedged_and_negated_sentences_claim_nothing(tree):
    text = "\n".join(
        [
            "# Page",
            "",
            "The SGLang engine backend is not yet supported for LoRA.",
            "NCCL on GPU is written for CUDA devices, untested on a GPU so far.",
            "",
            "| SGLang | working |",
            "",
            "```",
            "SGLang is working",
            "```",
        ]
    )
    found = sentences(text)
    assert [n for n, _ in found] == [3, 4]  # the table row and the code block are not prose
    page = tree / "docs" / "hedged.md"
    page.write_text(text, encoding="utf-8")
    try:
        assert [p for p in _prose(tree) if "hedged.md" in p] == []
    finally:
        page.unlink()


def test_a_live_test_that_passed_lifts_the_limit(tree):
    from tools.claims.evidence import Case

    page = tree / "docs" / "environments.md"
    original = page.read_text(encoding="utf-8")
    page.write_text(original + "\nE2B sandboxes are working.\n", encoding="utf-8")
    try:
        assert any("E2B" in p for p in _prose(tree))
        live = [Case("tests.integration.test_sandbox_providers_live", "test_e2b", "passed")]
        assert not any("E2B" in p for p in _prose(tree, live))
    finally:
        page.write_text(original, encoding="utf-8")
