"""The documentation's relative links resolve: every ``[text](path)`` and ``[text](path#anchor)``
in README.md, BUILD.md and docs/*.md names an existing file, and an anchor names a heading of
the target (GitHub's slugs: lower case, punctuation dropped, spaces to hyphens)."""

from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(
    [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "BUILD.md")]
    + glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    with open(path) as f:
        text = FENCE.sub("", f.read())
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def links(path: str) -> list[str]:
    with open(path) as f:
        return LINK.findall(FENCE.sub("", f.read()))


def test_there_are_pages_and_links() -> None:
    assert len(PAGES) >= 4 and os.path.exists(os.path.join(ROOT, "docs", "README.md"))
    assert sum(len(links(p)) for p in PAGES) > 20


@pytest.mark.parametrize("page", [os.path.relpath(p, ROOT) for p in PAGES])
def test_relative_links_resolve(page: str) -> None:
    source = os.path.join(ROOT, page)
    bad = []
    for target in links(source):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(source), path)) if path else source
        if not os.path.exists(full):
            bad.append(f"{target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in anchors(full):
            bad.append(f"{target}: no heading with that anchor")
    assert not bad, f"{page}: {bad}"
