"""How the suite runs side by side (pytest-xdist), and how a test that cannot runs alone.

The suite's default (``default_to_workers``, called by tests/conftest.py) is several
xdist workers with ``--dist loadgroup``, scheduled by ``GroupedSerialLastScheduling``:

* tests are handed out one at a time, to whichever worker is free;
* tests marked ``@pytest.mark.xdist_group("name")`` go to one worker together (a
  module-scoped fixture that would otherwise run once per worker: the chaos schedules);
* tests marked ``@pytest.mark.serial(reason="...")`` cannot run beside others (they
  measure the machine, or hold a resource by name): they are held back until every other
  test has run, and one worker runs them, one after another, while the others have ended.

With ``-n 0`` or ``-p no:xdist`` every test runs in place, in order (and a venv without
pytest-xdist runs the suite so too).

xdist's own ``loadgroup`` learns a test's group from its node id, to which workers append
``@name``; pytest 9.2 node ids no longer take that suffix, so here each worker writes the
groups it collected to a file the controller reads when it schedules (a directory named
in ``workerinput``). Runs in the xdist controller (``default_to_workers``,
``make_scheduler``, ``configure_node``) and in each worker (``mark_items``, ``write_groups``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

SERIAL_GROUP = "serial"
GROUPS_KEY = "tft_bridge_test_groups"  # workerinput: the directory where workers write their groups
_groups_directory = pytest.StashKey[Path]()


def mark_items(items: list[pytest.Item]) -> None:
    """Put each test marked ``serial`` in ``SERIAL_GROUP``; a ``serial`` mark without a
    reason, or a serial test in another group, is refused."""
    for item in items:
        mark = item.get_closest_marker("serial")
        if mark is None:
            continue
        if not (mark.kwargs.get("reason") or mark.args):
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.serial needs a reason "
                                    "(@pytest.mark.serial(reason=\"what it cannot share\"))")
        if item.get_closest_marker("xdist_group") is not None:
            raise pytest.UsageError(f"{item.nodeid}: a serial test cannot also be in an xdist_group")
        item.add_marker(pytest.mark.xdist_group(SERIAL_GROUP))


def group_of(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def configure_node(config: pytest.Config, node: Any) -> None:
    """Controller: tell a worker where to write its groups."""
    if _groups_directory not in config.stash:
        directory = Path(tempfile.mkdtemp(prefix="tft-bridge-suite-groups-"))
        config.stash[_groups_directory] = directory
        config.add_cleanup(lambda: shutil.rmtree(directory, ignore_errors=True))
    node.workerinput[GROUPS_KEY] = str(config.stash[_groups_directory])


def write_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Worker, once collection is final: {node id: group} of its grouped tests, written
    whole (a rename) before it reports its collection finished."""
    workerinput = getattr(config, "workerinput", None)
    if not workerinput or GROUPS_KEY not in workerinput:
        return
    groups = {item.nodeid: group for item in items if (group := group_of(item)) is not None}
    target = Path(workerinput[GROUPS_KEY]) / f"{workerinput['workerid']}.json"
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps(groups), encoding="utf-8")
    os.replace(partial, target)


def default_to_workers(config: pytest.Config, workers: int) -> None:
    """Controller, before xdist reads its options (tests/conftest.py wraps its hook):
    ``--dist loadgroup`` unless the command line chose a ``--dist`` or ``--tx``, with
    ``workers`` workers unless it chose ``-n``; nothing with ``-n 0``, ``-p no:xdist``,
    ``--pdb``, ``--collect-only`` or in a worker."""
    if not config.pluginmanager.has_plugin("xdist") or hasattr(config, "workerinput"):
        return
    option = config.option
    if option.tx or option.dist != "no" or option.collectonly or getattr(option, "usepdb", False):
        return
    if option.numprocesses is None:
        option.numprocesses = workers
    if option.numprocesses:
        option.dist = "loadgroup"


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The scheduler for ``--dist loadgroup``; None (xdist's own) for the other modes,
    under which serial tests run beside others."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupedSerialLastScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's scope scheduling with each ungrouped test a unit of its own, each
        group one unit, the largest first, and the ``SERIAL_GROUP`` unit held back until
        one worker (the runner) is left. The xdist controller's thread only."""

        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            self.groups: dict[str, str] = {}
            self.held_back: dict[str, bool] | None = None  # the serial unit, until it is sent
            self.runner: Any = None  # the worker that will run it, once the others ended

        def _split_scope(self, nodeid: str) -> str:
            return self.groups.get(nodeid, nodeid)

        def _read_groups(self) -> None:
            node = next(iter(self.registered_collections))
            path = Path(node.workerinput[GROUPS_KEY]) / f"{node.workerinput['workerid']}.json"
            self.groups = {nodeid: f"@group {group}" for nodeid, group in
                           json.loads(path.read_text(encoding="utf-8")).items()}

        def schedule(self) -> None:
            assert self.collection_is_completed
            if self.collection is not None:
                for node in self.nodes:
                    self._reschedule(node)
                return
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(next(iter(self.registered_collections.values())))
            if not self.collection:
                return
            self._read_groups()
            units: dict[str, dict[str, bool]] = {}
            for nodeid in self.collection:
                units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
            self.held_back = units.pop(f"@group {SERIAL_GROUP}", None)
            self.workqueue = OrderedDict(sorted(units.items(), key=lambda unit: -len(unit[1])))
            for node in self.nodes:
                self._reschedule(node)

        def _reschedule(self, node: Any) -> None:
            if node.shutting_down:
                return
            if self.workqueue:
                # A worker runs a test only once it holds the next one (or is told to end):
                # keep two pending on each, as xdist's own schedulers do.
                while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
                    self._assign_work_unit(node)
                return
            if self.held_back is None:
                node.shutdown()
                return
            # The queue is drained: this worker runs the serial tests, once the others
            # (told to end now) have run what they hold and ended.
            if self.runner is None:
                self.runner = node
                for other in self.nodes:
                    if other is not node and not other.shutting_down:
                        other.shutdown()
            elif node is not self.runner:
                node.shutdown()  # a worker xdist started after the choice (in place of a crashed one)
                return
            self._release_if_alone()

        def _release_if_alone(self) -> None:
            if self.held_back is None or self.runner is None or any(n is not self.runner for n in self.nodes):
                return
            self.workqueue[f"@group {SERIAL_GROUP}"] = self.held_back
            self.held_back = None
            self._assign_work_unit(self.runner)
            self.runner.shutdown()  # after what it was just sent

        def remove_node(self, node: Any) -> str | None:
            """A worker ended (or crashed): its unfinished tests go back to the queue, but
            for the one it crashed in, which xdist reports failed once (xdist's own scope
            schedulers put it back too, and it crashed every worker started in its place)."""
            workload = self.assigned_work.pop(node)
            crashed = next((nodeid for unit in workload.values() for nodeid, done in unit.items() if not done), None)
            if crashed is not None:
                for unit in workload.values():
                    if crashed in unit:
                        unit[crashed] = True
                self.workqueue.update({scope: unit for scope, unit in workload.items() if not all(unit.values())})
            if node is self.runner:
                self.runner = None
            for other in self.nodes:
                self._reschedule(other)
            self._release_if_alone()
            return crashed

        @property
        def tests_finished(self) -> bool:
            return self.held_back is None and bool(super().tests_finished)

        @property
        def has_pending(self) -> bool:
            return self.held_back is not None or bool(super().has_pending)

    return GroupedSerialLastScheduling(config, log)
