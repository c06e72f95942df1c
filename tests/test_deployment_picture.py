"""docs/deployment.svg is rendered from docs/deployment.dot: every label of the source is
in the picture and the picture has no text the source lacks, so an edit to the source
that was not rendered again fails here. Layout is Graphviz's and differs between its
versions, so only the words are compared, and Graphviz is not needed."""

from __future__ import annotations

import html
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def source_lines() -> set[str]:
    """Every line of every label in the .dot source (graph, cluster, node and edge labels)."""
    text = (DOCS / "deployment.dot").read_text(encoding="utf-8")
    lines: set[str] = set()
    for label in re.findall(r'\blabel="((?:[^"\\]|\\.)*)"', text):
        lines.update(line.strip() for line in re.split(r"\\[nlr]", label.replace('\\"', '"')) if line.strip())
    return lines


def picture_lines() -> set[str]:
    """Every line of text in the rendered .svg."""
    text = (DOCS / "deployment.svg").read_text(encoding="utf-8")
    return {html.unescape(line).strip() for line in re.findall(r"<text[^>]*>([^<]*)</text>", text) if line.strip()}


def test_the_picture_shows_what_its_source_says() -> None:
    source, picture = source_lines(), picture_lines()
    assert source - picture == set(), "docs/deployment.svg is older than docs/deployment.dot: render it again " \
                                      "(dot -Tsvg docs/deployment.dot -o docs/deployment.svg)"
    assert picture - source == set(), "docs/deployment.svg shows text docs/deployment.dot does not have"
