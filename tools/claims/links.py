"""Every relative link and `#anchor` in README.md and docs/ must resolve.

External links (http, mailto, ...) are not fetched: the check runs offline. Links inside
docs/ follow the site's rules: they must stay inside docs/ (the built site has nothing
else), name a file rather than a folder, and never be absolute paths.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from tools.claims import Problem
from tools.claims.markdown_scan import anchors_of, anchors_of_file, links


def check_links(root: Path, files: list[Path], docs_dir: Path) -> list[Problem]:
    problems: list[Problem] = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(root).as_posix()
        in_docs = docs_dir in path.parents
        for link in links(text):
            msg = _resolve(path, text, link.target, root, docs_dir if in_docs else None)
            if msg:
                problems.append(Problem(rel, link.line, f"link {link.target!r}: {msg}"))
    return problems


def _resolve(src: Path, src_text: str, target: str, root: Path, docs_dir: Path | None) -> str | None:
    """None when `target` resolves from `src`, else why it does not."""
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return None  # external: not checked offline
    if not target.strip():
        return "empty link target"
    path_part, fragment = unquote(parts.path), unquote(parts.fragment)
    if path_part.startswith("/"):
        return "absolute path; use a path relative to this file"
    if not path_part:
        if fragment and fragment not in anchors_of(src_text):
            return f"no anchor #{fragment} in this file"
        return None
    dest = (src.parent / path_part).resolve()
    base = docs_dir.resolve() if docs_dir is not None else root.resolve()
    if base != dest and base not in dest.parents:
        where = "docs/ (the site has nothing outside it)" if docs_dir is not None else "the repository"
        return f"points outside {where}"
    if not dest.exists():
        return f"{dest.relative_to(root.resolve()).as_posix()} does not exist"
    if docs_dir is not None and dest.is_dir():
        return "points to a folder; link the page (e.g. index.md) instead"
    if fragment and dest.suffix == ".md" and fragment not in anchors_of_file(dest):
        return f"no anchor #{fragment} in {dest.relative_to(root.resolve()).as_posix()}"
    return None
