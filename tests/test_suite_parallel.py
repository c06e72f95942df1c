"""The suite's own scheduling (tests/parallel.py), run as the suite runs: a nested pytest
with the suite's conftest as a plugin and the project's ini (xdist, --dist loadgroup), on
a scratch test file that logs when each test ran and where. The nested run must not take
this worker's identity (PYTEST_XDIST_* in the environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .processes import ROOT

SCRATCH = '''
import json, os, time
import pytest

def record(name):
    with open(os.environ["SCHEDULE_LOG"], "a") as log:
        log.write(json.dumps([name, "start", time.monotonic(), os.environ.get("PYTEST_XDIST_WORKER")]) + "\\n")
    # a fixed time spent inside the test, so that overlapping tests would be seen overlapping
    time.sleep(0.5)
    with open(os.environ["SCHEDULE_LOG"], "a") as log:
        log.write(json.dumps([name, "end", time.monotonic(), os.environ.get("PYTEST_XDIST_WORKER")]) + "\\n")

@pytest.mark.parametrize("i", range(8))
def test_free(i):
    record(f"free{i}")

@pytest.mark.serial(reason="the scheduling test's own")
@pytest.mark.parametrize("i", range(2))
def test_alone(i):
    record(f"alone{i}")

@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("i", range(3))
def test_grouped(i):
    record(f"grouped{i}")
'''


def nested_pytest(tmp_path: Path, source: str, *options: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    (tmp_path / "test_scratch.py").write_text(source)
    log = tmp_path / "schedule.jsonl"
    done = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "-p", "tests.conftest",
                           "-p", "no:cacheprovider", "-q",
                           *options, str(tmp_path / "test_scratch.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")},
                               "SCHEDULE_LOG": str(log), "PYTHONPATH": str(ROOT)})
    return done, log


def intervals(log: Path) -> dict[str, dict[str, Any]]:
    runs: dict[str, dict[str, Any]] = {}
    for line in log.read_text().splitlines():
        name, phase, at, worker = json.loads(line)
        runs.setdefault(name, {"worker": worker})[phase] = at
    return runs


def test_serial_tests_run_alone_after_the_others_and_a_group_on_one_worker(tmp_path: Path) -> None:
    done, log = nested_pytest(tmp_path, SCRATCH, "-n", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "13 passed" in done.stdout, done.stdout
    runs = intervals(log)
    assert len(runs) == 13
    others = {name: run for name, run in runs.items() if not name.startswith("alone")}
    assert len({run["worker"] for name, run in others.items() if name.startswith("free")}) > 1, \
        "the free tests ran on one worker: the suite is not side by side"
    # free tests ran beside the group, not only once the others were told to end (a worker
    # runs a test only once it holds the next one)
    first_free_start = min(run["start"] for name, run in others.items() if name.startswith("free"))
    assert first_free_start < max(run["end"] for name, run in others.items() if name.startswith("grouped")), runs
    assert len({run["worker"] for name, run in runs.items() if name.startswith("grouped")}) == 1
    last_other_end = max(run["end"] for run in others.values())
    for name in ("alone0", "alone1"):
        assert runs[name]["start"] > last_other_end, (name, runs)
    assert not (runs["alone0"]["start"] < runs["alone1"]["end"] and runs["alone1"]["start"] < runs["alone0"]["end"])


def test_with_no_workers_every_test_runs_in_place(tmp_path: Path) -> None:
    for option in (("-n", "0"), ("-p", "no:xdist")):
        done, log = nested_pytest(tmp_path, SCRATCH, *option)
        assert done.returncode == 0, done.stdout + done.stderr
        assert {run["worker"] for run in intervals(log).values()} == {None}, option
        log.unlink()


def test_a_plain_run_is_side_by_side(tmp_path: Path) -> None:
    done, log = nested_pytest(tmp_path, SCRATCH)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len({run["worker"] for run in intervals(log).values()}) > 1, done.stdout


def test_a_serial_mark_without_a_reason_is_refused(tmp_path: Path) -> None:
    done, _ = nested_pytest(tmp_path, "import pytest\n@pytest.mark.serial\ndef test_x():\n    pass\n", "-p", "no:xdist")
    assert done.returncode == 4, done.stdout + done.stderr
    assert "needs a reason" in done.stdout + done.stderr


def test_a_test_that_crashes_its_worker_fails_once_and_the_rest_still_run(tmp_path: Path) -> None:
    """xdist's scope scheduling puts a crashed worker's tests back whole, the crashing one
    included, so it crashed every worker xdist started in its place."""
    source = SCRATCH + "\ndef test_crash():\n    os._exit(3)\n"
    done, log = nested_pytest(tmp_path, source, "-n", "3")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 13 passed" in done.stdout, done.stdout
    assert done.stdout.count("crashed while running") == 2, done.stdout  # the failure and its summary line
