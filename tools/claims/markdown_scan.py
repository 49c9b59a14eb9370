"""Reading Markdown the way the site builder does: links with their lines, anchors, markers.

Links are found with markdown-it (a CommonMark parser), so a `[x](y)` inside a code span or
fenced block is not mistaken for a link. Anchors are computed by rendering the page with
Python-Markdown and the same `toc` extension MkDocs uses, then collecting every `id=`: this
is exactly the set of fragments the built site has (heading slugs with `_1` suffixes for
duplicates, `{#custom}` ids, raw `<a id=...>`), so no slug rule is re-implemented here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import markdown
from markdown_it import MarkdownIt

# The extensions that change which ids a page has; mkdocs.yml enables the same ones.
ANCHOR_EXTENSIONS = [
    "toc",
    "attr_list",
    "md_in_html",
    "tables",
    "admonition",
    "pymdownx.superfences",
    "pymdownx.details",
]

_HREF = re.compile(r"""\bhref\s*=\s*["']([^"']+)["']""")
_ID = re.compile(r"""\bid\s*=\s*["']([^"']+)["']""")


@dataclass(frozen=True)
class Link:
    line: int  # 1-based
    target: str


@dataclass(frozen=True)
class Marked:
    """A value written between markers, e.g. `<!-- count:recipes -->9<!-- /count -->`."""

    line: int
    name: str
    value: str


def _parser() -> MarkdownIt:
    return MarkdownIt("commonmark").enable("table")


def links(text: str) -> list[Link]:
    """Every link and image target in `text`, with the line it is written on."""
    out: list[Link] = []
    for tok in _parser().parse(text):
        if tok.map is None:
            continue
        start = tok.map[0] + 1
        if tok.type in ("html_block",):
            for i, line in enumerate(tok.content.splitlines()):
                out += [Link(start + i, m) for m in _HREF.findall(line)]
        if tok.type != "inline" or not tok.children:
            continue
        line = start
        for child in tok.children:
            if child.type in ("softbreak", "hardbreak"):
                line += 1
            elif child.type == "link_open":
                out.append(Link(line, str(child.attrs.get("href", ""))))
            elif child.type == "image":
                out.append(Link(line, str(child.attrs.get("src", ""))))
            elif child.type == "html_inline":
                out += [Link(line, m) for m in _HREF.findall(child.content)]
            elif child.type in ("text", "code_inline"):
                line += child.content.count("\n")
    return out


def code_lines(text: str) -> set[int]:
    """1-based numbers of lines inside fenced or indented code blocks."""
    lines: set[int] = set()
    for tok in _parser().parse(text):
        if tok.type in ("fence", "code_block") and tok.map:
            lines.update(range(tok.map[0] + 1, tok.map[1] + 1))
    return lines


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for lines outside code blocks, with inline code spans blanked."""
    skip = code_lines(text)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if n not in skip:
            out.append((n, re.sub(r"(`+)(?:(?!\1).)+\1", lambda m: " " * len(m.group(0)), line)))
    return out


def marked(text: str, kind: str) -> list[Marked]:
    """Values between `<!-- KIND:NAME -->` and `<!-- /KIND -->` on one line, outside code."""
    pattern = re.compile(rf"<!--\s*{kind}:([\w.-]+)\s*-->(.*?)<!--\s*/{kind}\s*-->")
    out = []
    skip = code_lines(text)
    for n, line in enumerate(text.splitlines(), 1):
        if n not in skip:
            out += [Marked(n, m.group(1), m.group(2).strip()) for m in pattern.finditer(line)]
    return out


def strip_markers(line: str, kind: str) -> str:
    """The line with every `<!-- KIND:... -->...<!-- /KIND -->` span removed."""
    return re.sub(rf"<!--\s*{kind}:[\w.-]+\s*-->.*?<!--\s*/{kind}\s*-->", " ", line)


def anchors_of(text: str) -> set[str]:
    """Every fragment id the rendered page has."""
    return _anchors(text)


@lru_cache(maxsize=256)
def _anchors(text: str) -> set[str]:
    html = markdown.Markdown(extensions=ANCHOR_EXTENSIONS).convert(text)
    return set(_ID.findall(html))


def anchors_of_file(path: Path) -> set[str]:
    return _anchors(path.read_text(encoding="utf-8"))
