"""Shared fixtures and the one way a test waits.

``codec`` runs a test once per fault-codec implementation (the aio-libs
propcache/yarl pattern): the compiled twin and the Python reference.

``eventually`` (and ``eventually_sync`` for threads without a loop) is the only way a
test waits for the bridge, which works asynchronously: it polls the very thing the test
asserts, so a loaded 2-core machine only makes a test slower, never red. A test never
sleeps and then acts; where a fixed delay is itself the behaviour under test, a
comment says so.

``jobs`` and ``notifier`` serve the end-to-end tests built on simulated jobs (helpers in
tests/simjobs.py, imported lazily so the codec tests do not load gRPC).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

from bridge.core import listen_ports as ports

from . import parallel

if TYPE_CHECKING:
    from bridge.sim.scenario import SimulatedJob

    from .simjobs import RecordingNotifier


@dataclass(frozen=True)
class CodecImplementation:
    is_pure_python: bool

    def __str__(self) -> str:
        return "pure-python" if self.is_pure_python else "c-extension"

    @property
    def module(self) -> ModuleType:
        name = "bridge.faults._python" if self.is_pure_python else "bridge.faults._c"
        return importlib.import_module(name)


#: Set by the suite to the $STATE_DIRECTORY it made, so that an xdist worker, which
#: inherits the controller's environment, can tell the suite's directory (to be replaced
#: by one of its own) from one the person running the suite chose.
SUITE_STATE_ENV = "TFT_BRIDGE_SUITE_STATE_DIRECTORY"


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker, and the processes it starts, pick listening ports from a slice of
    their own (bridge/core/listen_ports.py), a part of the run's own where it has one
    (.ci/run gives each stage beside the suite a part). Bridges the suite starts keep their flight record (bridge/job/recorder/) in
    $STATE_DIRECTORY, else /var/lib/tft-bridge/<job>: point it at a directory of the
    process's own (each xdist worker its own), so a suite run as root leaves nothing on the
    machine and no two workers share a store. Each test then gets a fresh one of its own
    (``state_directory_per_test``); this one serves module-scoped fixtures."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):  # a worker's own slice of the ports the simulations pick (bridge/core/listen_ports.py)
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        os.environ[ports.SLICE_ENV] = ports.child_slice(int(worker[2:]) % count + 1, count)
    given = os.environ.get("STATE_DIRECTORY")
    if given is None or given == os.environ.get(SUITE_STATE_ENV):
        directory = tempfile.mkdtemp(prefix=f"tft-bridge-suite-state-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")
        os.environ["STATE_DIRECTORY"] = os.environ[SUITE_STATE_ENV] = directory
        config.add_cleanup(lambda: shutil.rmtree(directory, ignore_errors=True))


@pytest.fixture(autouse=True)
def state_directory_per_test(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every test's bridges (in process or children started with the environment) keep
    their flight record and orphan markers in a directory of the test's own: no test
    reads another's store, whichever worker ran it before. Only where the suite chose the
    directory: one the person running the suite set is left alone."""
    if os.environ.get("STATE_DIRECTORY") == os.environ.get(SUITE_STATE_ENV):
        monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path_factory.mktemp("state")))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--c-extensions",
        action=argparse.BooleanOptionalAction,
        default=not os.environ.get("BRIDGE_NO_EXTENSIONS"),
        help="run the codec tests against the compiled extension too",
    )


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Any:
    """Before every other implementation: serial tests put in their group (tests/parallel.py)
    and, without the compiled codec, its tests skipped; after them all, with the node ids
    final, an xdist worker writes its groups for the controller's scheduler."""
    parallel.mark_items(items)
    if not config.getoption("--c-extensions"):
        skip = pytest.mark.skip(reason="--no-c-extensions")
        for item in items:
            if "c_extension" in item.keywords:
                item.add_marker(skip)
    result = yield
    parallel.write_groups(config, items)
    return result


#: xdist workers of a plain ``pytest`` run (tests/parallel.py; docs/testing.md says how the
#: number was chosen). ``-n N`` chooses another; ``-n 0`` or ``-p no:xdist``, none.
DEFAULT_WORKERS = 6


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config) -> Any:
    """The suite runs side by side unless the command line said otherwise: decided before
    xdist reads its options, whichever plugin was registered first."""
    parallel.default_to_workers(config, DEFAULT_WORKERS)
    return (yield)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist controller, for each worker it starts (tests/parallel.py)."""
    parallel.configure_node(node.config, node)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist controller: groups, and serial tests last and alone (tests/parallel.py)."""
    return parallel.make_scheduler(config, log)


TESTS = Path(__file__).resolve().parent
SYSTEMD_TIER = TESTS / "systemd"


def _run_covers(config: pytest.Config, directory: Path) -> bool:
    """Whether the run's paths (or the default testpaths) include ``directory``."""
    paths = [Path(arg.split("::")[0]).resolve() for arg in config.args] or [TESTS]
    return any(path == directory or path in directory.parents or directory in path.parents for path in paths)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The tiers that cannot run here say so in one line, even under ``-q`` (which lists no
    skip reasons). Here, not in the tiers' own conftests: under xdist only the controller
    prints the summary, and it loads no conftest below this one."""
    said: set[str] = set()  # under xdist one worker reports the tier's module skip, whichever module it was
    for report in terminalreporter.stats.get("skipped", []):
        if "conformance/test_real_" in report.nodeid and isinstance(report.longrepr, tuple):
            line = str(report.longrepr[2]).removeprefix("Skipped: ")
            if line.startswith("conformance tier") and line not in said:
                said.add(line)
                terminalreporter.write_line(line)
    if _run_covers(terminalreporter.config, SYSTEMD_TIER):
        from .systemd.sdns import missing

        why_not = missing()
        if why_not:
            terminalreporter.write_line(f"systemd tier (tests/systemd) skipped: {why_not}")


@pytest.fixture(
    scope="session",
    params=[
        pytest.param(CodecImplementation(False), marks=pytest.mark.c_extension),
        CodecImplementation(True),
    ],
    ids=str,
)
def codec(request: pytest.FixtureRequest) -> ModuleType:
    impl: CodecImplementation = request.param
    if not impl.is_pure_python:
        pytest.importorskip("bridge.faults._c", reason="C extension not built")
    return impl.module


POLL_INTERVAL = 0.01


def _awaited(what: str, timeout: float, last: Any) -> AssertionError:
    return AssertionError(f"{what}: not reached within {timeout} s (last value seen: {last!r})")


async def eventually(predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    """Poll ``predicate`` on the running loop until it returns a truthy value, and return
    that value; fail naming ``what`` and the last value seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if loop.time() > deadline:
            raise _awaited(what, timeout, last)
        await asyncio.sleep(POLL_INTERVAL)


def eventually_sync(predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition",
                    interval: float = POLL_INTERVAL) -> Any:
    """``eventually`` for plain threads (no event loop in the test). ``interval``: for a
    predicate that asks another process (an HTTP poll each time), a longer pause."""
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() > deadline:
            raise _awaited(what, timeout, last)
        time.sleep(interval)


@pytest.fixture
async def jobs() -> AsyncIterator[list[SimulatedJob]]:
    """The simulated jobs a test started (``simjobs.start_job`` adds them); each one still
    listed is stopped at teardown, pass or fail. A test that stops one itself removes it."""
    running: list[SimulatedJob] = []
    yield running
    for job in running:
        await job.stop()


@pytest.fixture
async def clean_jobs() -> AsyncIterator[list[SimulatedJob]]:
    """``jobs``, and at teardown neither peer of any of them recorded a protocol violation
    (the simulated ClusterD's and the stub controller's: what the real ones punish)."""
    running: list[SimulatedJob] = []
    yield running
    for job in running:
        violations = list(job.sim.violations), list(job.training.violations)
        await job.stop()
        assert violations == ([], []), violations


@pytest.fixture
def notifier(monkeypatch: pytest.MonkeyPatch) -> RecordingNotifier:
    """The sd_notify messages of every bridge the test starts through ``SimulatedJob``."""
    import bridge.sim.scenario as scenario

    from .simjobs import RecordingNotifier

    recording = RecordingNotifier()
    monkeypatch.setattr(scenario, "Notifier", lambda env: recording)
    return recording


@contextlib.asynccontextmanager
async def recover_server(method: str, answer: Callable[[bytes, Any], Awaitable[bytes]]) -> AsyncIterator[str]:
    """A gRPC server on loopback with one ``Recover`` method, answered by ``answer``
    (request bytes and context in, response bytes out); yields its address. For the
    answers the simulated ClusterD never gives (a made-up code, no answer at all)."""
    import grpc

    handler = grpc.method_handlers_generic_handler("Recover", {method: grpc.unary_unary_rpc_method_handler(answer)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)
