"""docs/architecture.md's two pictures match the code.

Each picture is drawn from a Graphviz source in ``docs/images/`` into an SVG beside it.
These tests hold each SVG to its source (every node and edge of the source is drawn,
nothing else) and each source to the code:

- ``threads.dot``: every thread the bridge starts by name is in the picture, and the
  picture names no thread the bridge does not start;
- ``modules.dot``: one box per room of ``tests/test_layout.py``, every module of the
  product listed in its room's box and no name the code lacks, and an edge for exactly
  the imports between rooms (``tests/test_import_cycles.imports_of``).

A thread, module or import between rooms added, renamed or removed fails here, with the
line to change, until the picture says so.
"""

from __future__ import annotations

import ast
import fnmatch
import html
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from .test_import_cycles import PACKAGE, imports_of, module_names
from .test_layout import MAY_IMPORT, room_of, write_package

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "docs" / "images" / "threads.dot"
PICTURE = ROOT / "docs" / "images" / "threads.svg"
#: A thread's name as the bridge gives it (threading.Thread(name=...), an executor's prefix).
THREAD_NAME = re.compile(r"""(?:\bname|thread_name_prefix)="(tft-[a-z-]+)\"""")


def drawn(svg: str, graph: str = "threads") -> set[str]:
    """The nodes and edges an SVG from Graphviz draws, by their titles."""
    return {html.unescape(title) for title in re.findall(r"<title>(.*?)</title>", svg)} - {graph}


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


# The picture of the programs and their modules.

MODULES_SOURCE = ROOT / "docs" / "images" / "modules.dot"
MODULES_PICTURE = ROOT / "docs" / "images" / "modules.svg"
RENDER = "dot -Tsvg docs/images/modules.dot -o docs/images/modules.svg"
#: Rooms whose box may summarise: a row may name a subpackage (``kube/``) or a glob (``clusterd*``).
SUMMARISED = frozenset({"bridge.sim", "bridge._proto"})
#: A room's box: ``"bridge.job" [label=<...>];``.
_BOX = re.compile(r'^\s*"([a-z_.]+)"\s*\[label=<(.*?)>\];', re.MULTILINE | re.DOTALL)
#: A row of a box: the package's path under bridge/ in bold, then its modules' names.
_ROW = re.compile(r"<td[^>]*><b>([a-z_/]+/)</b></td>\s*<td[^>]*>(.*?)</td>", re.DOTALL)
_EDGE = re.compile(r'^\s*"([a-z_.]+)"\s*->\s*"([a-z_.]+)"', re.MULTILINE)


@dataclass(frozen=True)
class ModulePicture:
    """What ``modules.dot`` says: each room's rows (package path, listed name), and its edges."""

    boxes: dict[str, list[tuple[str, str]]]
    edges: set[tuple[str, str]]


def read_module_picture(dot: str) -> ModulePicture:
    """The boxes and edges of a module picture's Graphviz source."""
    body = re.sub(r"^\s*//[^\n]*", "", dot, flags=re.MULTILINE)
    boxes: dict[str, list[tuple[str, str]]] = {}
    for room, label in _BOX.findall(body):
        assert room not in boxes, f"docs/images/modules.dot draws the box {room!r} twice"
        boxes[room] = [(path, name) for path, names in _ROW.findall(label)
                       for name in re.sub(r"<[^>]*>", " ", names).split()]
    return ModulePicture(boxes, set(_EDGE.findall(body)))


def package_of(path: str, package: str) -> str:
    """``job/session/`` -> ``bridge.job.session``."""
    return ".".join([package, *path.strip("/").split("/")])


def has_code(path: Path) -> bool:
    """Whether a module has a statement besides its docstring."""
    return any(not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
               for node in ast.parse(path.read_text(encoding="utf-8")).body)


def listed_modules(package: str, name: str, modules: dict[str, Path], summarised: bool) -> set[str]:
    """The modules a name in a package's row stands for: ``__init__`` the package itself;
    in a summarised room also ``sub/`` (a subpackage and all under it) and globs."""
    if name == "__init__":
        return {package} if package in modules else set()
    if not summarised:
        module = f"{package}.{name}"
        return {module} if module in modules and modules[module].name != "__init__.py" else set()
    pattern = name.rstrip("/")
    return {module for module in modules if module.startswith(package + ".")
            and fnmatch.fnmatchcase(module[len(package) + 1:].split(".")[0], pattern)
            and (name.endswith("/") or "." not in module[len(package) + 1:])}


def import_edges(modules: dict[str, Path], rooms: set[str]) -> dict[tuple[str, str], str]:
    """Every pair of rooms one imports the other, with the first such import as its example."""
    found: dict[tuple[str, str], str] = {}
    for module, path in sorted(modules.items()):
        for imported in sorted(imports_of(module, path, modules)):
            pair = (room_of(module, rooms), room_of(imported, rooms))
            if pair[0] != pair[1]:
                found.setdefault(pair, f"{module} imports {imported}")
    return found


def picture_problems(picture: ModulePicture, root: Path, package: str,
                     may_import: dict[str, frozenset[str]], summarised: frozenset[str]) -> list[str]:
    """Every way the module picture and the code disagree, each saying what to change."""
    modules = module_names(root, package)
    rooms = set(may_import)
    problems = [f'room {room} has no box: add `"{room}" [label=<...>];`' for room in sorted(rooms - set(picture.boxes))]
    problems += [f"box {room} is no room of tests/test_layout.py's MAY_IMPORT: remove the box"
                 for room in sorted(set(picture.boxes) - rooms)]
    listed: set[str] = set()
    rows: set[str] = set()
    for room, names in sorted(picture.boxes.items()):
        if not names and room in modules:
            listed.add(room)
        for path, name in names:
            where = package_of(path, package)
            rows.add(where)
            found = listed_modules(where, name, modules, room in summarised)
            if not found:
                problems.append(f"box {room}, row {path}: {name} is no module of {where}: remove or rename it")
            for module in sorted(found):
                if room_of(module, rooms) != room:
                    problems.append(f"box {room}, row {path}: {name} is in room {room_of(module, rooms)}: move it there")
            listed |= found
    for module, path in sorted(modules.items()):
        if module in listed or (path.name == "__init__.py" and not has_code(path) and module in rows):
            continue
        room = room_of(module, rooms)
        row, short = (module, "__init__") if path.name == "__init__.py" else module.rsplit(".", 1)
        if room in summarised and module != room:
            below = module[len(room) + 1:]
            row, short = room, below.split(".")[0] + ("/" if "." in below or path.name == "__init__.py" else "")
        row_path = "/".join(row.split(".")[1:]) + "/"
        if row not in rows:
            listing = "" if short == "__init__" and not has_code(path) else f" listing {short}"
            problems.append(f"{module} is not in the picture: add a row {row_path}{listing} to box {room}")
        else:
            problems.append(f"{module} is not in the picture: add {short} to row {row_path} of box {room}")
    drawn_edges = picture.edges
    code_edges = import_edges(modules, rooms)
    problems += [f'edge "{a}" -> "{b}" is missing ({example}): add it'
                 for (a, b), example in sorted(code_edges.items()) if (a, b) not in drawn_edges]
    problems += [f'edge "{a}" -> "{b}" is drawn but no module of {a} imports {b}: remove it'
                 for a, b in sorted(drawn_edges - set(code_edges))]
    return problems


def test_the_module_picture_shows_every_module_and_every_import_between_rooms() -> None:
    picture = read_module_picture(MODULES_SOURCE.read_text(encoding="utf-8"))
    assert {"bridge.core", "bridge.job", "bridge.node", "bridge.platform", "bridge.sim"} <= set(picture.boxes)
    problems = picture_problems(picture, PACKAGE, "bridge", MAY_IMPORT, SUMMARISED)
    assert not problems, ("docs/images/modules.dot disagrees with bridge/; change it, then " + RENDER + ":\n  "
                          + "\n  ".join(problems))


def test_a_wrong_module_picture_is_found(tmp_path: Path) -> None:
    """The check can fail: a module left out, a name the code lacks, a module in the wrong
    room's box, a package with code whose ``__init__`` is not listed, a missing and a
    surplus edge; a code-less package is pictured by its row, a summarised room by globs."""
    package = write_package(tmp_path / "pkg", {
        "__init__.py": "", "job/__init__.py": '"""A package."""\n', "job/session/__init__.py": '"""A package."""\n',
        "sim/__init__.py": '"""A package."""\n', "sim/kube/__init__.py": '"""A package."""\n',
        "core/__init__.py": "from pkg.core import config\n", "core/config.py": "", "core/files.py": "",
        "job/daemon.py": "from pkg.core import config\n",
        "job/session/clusterd.py": "", "job/session/codes.py": "",
        "sim/clusterd_a.py": "from pkg.job import daemon\n",
        "sim/kube/apiserver.py": "from pkg.core import files\n",
    })
    rules = {"pkg": frozenset(), "pkg.core": frozenset(), "pkg.job": frozenset({"pkg.core"}),
             "pkg.sim": frozenset({"pkg.core", "pkg.job"})}
    dot = '''digraph modules {
  "pkg" [label=<<table><tr><td>pkg</td></tr></table>>];
  "pkg.core" [label=<<table><tr><td><b>core/</b></td><td>config files</td></tr></table>>];
  "pkg.job" [label=<<table><tr><td><b>job/</b></td><td>daemon ghost</td></tr>
    <tr><td><b>job/session/</b></td><td>clusterd</td></tr></table>>];
  "pkg.sim" [label=<<table><tr><td><b>sim/</b></td><td>__init__ clusterd* kube/</td></tr></table>>];
  "pkg.job" -> "pkg.core";
  "pkg.sim" -> "pkg.core";
  "pkg.core" -> "pkg.job";
}'''
    problems = picture_problems(read_module_picture(dot), package, "pkg", rules, frozenset({"pkg.sim"}))
    assert problems == [
        "box pkg.job, row job/: ghost is no module of pkg.job: remove or rename it",
        "pkg.core is not in the picture: add __init__ to row core/ of box pkg.core",
        "pkg.job.session.codes is not in the picture: add codes to row job/session/ of box pkg.job",
        'edge "pkg.sim" -> "pkg.job" is missing (pkg.sim.clusterd_a imports pkg.job.daemon): add it',
        'edge "pkg.core" -> "pkg.job" is drawn but no module of pkg.core imports pkg.job: remove it',
    ]
    moved = dot.replace("config files", "__init__ config").replace("daemon ghost", "daemon").replace(
        "<td>clusterd</td>", "<td>clusterd codes</td></tr><tr><td><b>core/</b></td><td>files</td>")
    moved = moved.replace('"pkg.core" -> "pkg.job";', '"pkg.sim" -> "pkg.job";')
    assert picture_problems(read_module_picture(moved), package, "pkg", rules, frozenset({"pkg.sim"})) == [
        "box pkg.job, row core/: files is in room pkg.core: move it there",
    ]


def svg_words(svg: str) -> list[str]:
    """Every word an SVG from Graphviz writes, sorted."""
    return sorted(word for text in re.findall(r"<text[^>]*>(.*?)</text>", svg) for word in html.unescape(text).split())


def source_words(dot: str) -> list[str]:
    """Every word of a Graphviz source's HTML labels and its graph label, sorted."""
    body = re.sub(r"^\s*//[^\n]*", "", dot, flags=re.MULTILINE)
    labels = [re.sub(r"<[^>]*>", " ", label) for label in re.findall(r"label=<(.*?)>\];", body, re.DOTALL)]
    labels += re.findall(r'label="([^"]*)"', body)
    return sorted(word for label in labels for word in html.unescape(label).split())


def module_picture_declared(dot: str) -> set[str]:
    """The boxes and edges of the module picture's source, as Graphviz titles them."""
    picture = read_module_picture(dot)
    return set(picture.boxes) | {f"{a}->{b}" for a, b in picture.edges}


def test_the_module_picture_is_its_sources_rendering() -> None:
    source = MODULES_SOURCE.read_text(encoding="utf-8")
    svg = MODULES_PICTURE.read_text(encoding="utf-8")
    assert drawn(svg, "modules") == module_picture_declared(source), f"redraw it: {RENDER}"
    assert svg_words(svg) == source_words(source), f"redraw it: {RENDER}"


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed (apt-get install graphviz)")
def test_rendering_the_module_source_again_draws_the_same_picture() -> None:
    svg = subprocess.run(["dot", "-Tsvg", str(MODULES_SOURCE)], check=True, capture_output=True, text=True,
                         timeout=60).stdout
    picture = MODULES_PICTURE.read_text(encoding="utf-8")
    assert (drawn(svg, "modules"), svg_words(svg)) == (drawn(picture, "modules"), svg_words(picture))


def test_the_architecture_page_shows_the_module_picture() -> None:
    assert "images/modules.svg" in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
