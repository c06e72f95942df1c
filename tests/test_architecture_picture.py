"""docs/architecture.md's picture of the threads matches the code.

The picture is drawn from ``docs/images/threads.dot`` (Graphviz) into
``docs/images/threads.svg``. These tests hold the SVG to its source (every node and edge
of the source is drawn, nothing else) and the source to the code (every thread the
bridge starts by name is in the picture, and the picture names no thread the bridge
does not start), so a thread added, renamed or removed fails here until the picture
says so.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "docs" / "images" / "threads.dot"
PICTURE = ROOT / "docs" / "images" / "threads.svg"
#: A thread's name as the bridge gives it (threading.Thread(name=...), an executor's prefix).
THREAD_NAME = re.compile(r"""(?:\bname|thread_name_prefix)="(tft-[a-z-]+)\"""")


def drawn(svg: str) -> set[str]:
    """The nodes and edges an SVG from Graphviz draws, by their titles."""
    return {html.unescape(title) for title in re.findall(r"<title>(.*?)</title>", svg)} - {"threads"}


def declared(dot: str) -> set[str]:
    """The nodes and edges of the Graphviz source."""
    body = re.sub(r"//[^\n]*", "", dot)
    nodes = set(re.findall(r"^\s*([a-z_]+)\s*\[", body, re.MULTILINE)) - {"graph", "node", "edge"}
    edges = {f"{a}->{b}" for a, b in re.findall(r"^\s*([a-z_]+)\s*->\s*([a-z_]+)", body, re.MULTILINE)}
    return nodes | edges


def test_the_picture_is_its_sources_rendering() -> None:
    assert drawn(PICTURE.read_text(encoding="utf-8")) == declared(SOURCE.read_text(encoding="utf-8"))


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed (apt-get install graphviz)")
def test_rendering_the_source_again_draws_the_same_picture() -> None:
    svg = subprocess.run(["dot", "-Tsvg", str(SOURCE)], check=True, capture_output=True, text=True, timeout=60).stdout
    assert drawn(svg) == drawn(PICTURE.read_text(encoding="utf-8"))


def test_every_thread_the_bridge_starts_is_in_the_picture_and_no_other() -> None:
    started = {name for path in (ROOT / "bridge").rglob("*.py") if "sim" not in path.relative_to(ROOT / "bridge").parts
               for name in THREAD_NAME.findall(path.read_text(encoding="utf-8"))}
    assert {"tft-wire", "tft-notify"} <= started  # the report and signal paths' own
    pictured = set(re.findall(r"tft-[a-z]+(?:-[a-z]+)*", SOURCE.read_text(encoding="utf-8")))
    assert pictured == started


def test_the_architecture_page_shows_the_picture() -> None:
    assert "images/threads.svg" in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
