"""The package's layout is its programs, and imports point one way (docs/architecture.md).

Each room of ``bridge/`` may import only the rooms listed for it in ``MAY_IMPORT``: the
shared core below everything, the fault codec above it, the per-job bridge above both,
the node service and the platform agent beside each other on core and codec only, and the
command line on top. The simulations (``bridge.sim``) may use the product; the product
never imports them (it finds the stub controller and the simulated commands by name).
Every import counts, as in ``test_import_cycles``: module level, ``TYPE_CHECKING`` or late.
"""

from __future__ import annotations

from pathlib import Path

from .test_import_cycles import PACKAGE, imports_of, module_names

#: Every room and the rooms its modules may import (its own always allowed).
MAY_IMPORT: dict[str, frozenset[str]] = {
    "bridge": frozenset({"bridge._version"}),
    "bridge._version": frozenset(),
    "bridge._proto": frozenset(),
    "bridge.core": frozenset({"bridge._version"}),
    "bridge.faults": frozenset(),
    "bridge.job": frozenset({"bridge._version", "bridge._proto", "bridge.core", "bridge.faults"}),
    "bridge.node": frozenset({"bridge._version", "bridge.core", "bridge.faults"}),
    "bridge.platform": frozenset({"bridge._version", "bridge._proto", "bridge.core", "bridge.faults"}),
    "bridge.recover_manager": frozenset({"bridge._version", "bridge._proto", "bridge.core", "bridge.faults",
                                         "bridge.job"}),
    "bridge.cli": frozenset({"bridge._version", "bridge.core", "bridge.faults", "bridge.job", "bridge.node",
                             "bridge.platform"}),
    "bridge.sim": frozenset({"bridge._version", "bridge._proto", "bridge.core", "bridge.faults", "bridge.job",
                             "bridge.node", "bridge.platform"}),
}
#: Inside the per-job bridge, the scheduling helpers are its floor: they import no other part of it.
FLOORS: dict[str, str] = {"bridge.job.sched": "bridge.job"}


def write_package(root: Path, files: dict[str, str]) -> Path:
    """A fixture package under ``root``: each relative path written with its text."""
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def room_of(module: str, rooms: set[str]) -> str:
    """The longest room name that is ``module`` or a package holding it."""
    parts = module.split(".")
    for size in range(len(parts), 0, -1):
        name = ".".join(parts[:size])
        if name in rooms:
            return name
    raise AssertionError(f"{module} is in no room of MAY_IMPORT: add it to the layout (docs/architecture.md)")


def violations(package: Path, name: str, may_import: dict[str, frozenset[str]],
               floors: dict[str, str]) -> list[str]:
    """``importer -> imported`` for every import the layout forbids, sorted."""
    modules = module_names(package, name)
    rooms = set(may_import)
    found = []
    for module, path in modules.items():
        room = room_of(module, rooms)
        for imported in imports_of(module, path, modules):
            target = room_of(imported, rooms)
            if target != room and target not in may_import[room]:
                found.append(f"{module} -> {imported}")
            for floor, building in floors.items():
                inside = module == floor or module.startswith(floor + ".")
                into_building = imported.startswith(building + ".")
                if inside and into_building and not (imported == floor or imported.startswith(floor + ".")):
                    found.append(f"{module} -> {imported}")
    return sorted(found)


def test_every_import_points_down_and_nothing_imports_the_simulations() -> None:
    modules = module_names(PACKAGE, "bridge")
    assert {"bridge.core.config", "bridge.faults", "bridge.job.daemon", "bridge.node.service",
            "bridge.platform.agent", "bridge.sim.clusterd", "bridge.recover_manager"} <= set(modules)
    assert violations(PACKAGE, "bridge", MAY_IMPORT, FLOORS) == []


def test_an_upward_import_and_an_import_of_the_simulations_are_found(tmp_path: Path) -> None:
    """The check can fail: the core importing the job, the job importing the simulations
    (even late, inside a function), and a floor importing the room above it."""
    package = write_package(tmp_path / "bridge", {
        "__init__.py": "", "core/__init__.py": "", "job/__init__.py": "", "job/sched/__init__.py": "",
        "sim/__init__.py": "",
        "core/config.py": "from bridge.job import daemon\n",
        "job/daemon.py": "def f():\n    from bridge.sim import stub\n",
        "job/metrics.py": "from bridge.core import config\n",
        "job/sched/affinity.py": "from bridge.job import metrics\n",
        "sim/stub.py": "from bridge.job import daemon\n",
    })
    rules = {"bridge": frozenset(), "bridge.core": frozenset(), "bridge.job": frozenset({"bridge.core"}),
             "bridge.sim": frozenset({"bridge.core", "bridge.job"})}
    assert violations(package, "bridge", rules, {"bridge.job.sched": "bridge.job"}) == [
        "bridge.core.config -> bridge.job.daemon",
        "bridge.job.daemon -> bridge.sim.stub",
        "bridge.job.sched.affinity -> bridge.job.metrics",
    ]
