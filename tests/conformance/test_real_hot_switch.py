"""A hot switch on the real peers, as far as the harness can take one.

ClusterD's real hot-switch controller starts from a sub-healthy NPU fault when the
PodGroup label ``subHealthyStrategy`` is ``hotSwitch``: it sends ``hot switch`` with the
pod's ranks and waits one minute for a backup pod to run. The harness cannot make that
pod (one annotated as a backup, which the operator creates), so ClusterD then sends
``stop switch`` and resets. What this shows on the real controller and ClusterD: the hot
switch reaches the controller, the bridge withholds the stop switch (the real controller
would keep it in its wake-up slot and end the next fault flow it detects), no flow
desync and no refused signal are counted, and a process fault after it still recovers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from bridge.sim.scenario import free_port

from ..conftest import eventually_sync
from ..processes import ROOT
from .peers import BridgeDaemon, HarnessOptions, LogTail, Ranks, find_real_peers
from .realjob import RealJob
from .tier import skip_unless_the_tier_runs_here

skip_unless_the_tier_runs_here()
pytestmark = [pytest.mark.real_peers, pytest.mark.timeout(400)]

SUB_HEALTHY_RANK = 2  # pod 1 (2 devices per pod): not the master pod


def metrics(entry: BridgeDaemon) -> str:
    """The bridge's Prometheus text (its metrics port is in its log)."""
    _, match = entry.log.find(r"metrics on http://(127\.0\.0\.1:\d+)")[-1]
    with urllib.request.urlopen(f"http://{match.group(1)}/metrics", timeout=10) as response:
        text: str = response.read().decode()
    return text


def sample(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_a_hot_switch_without_a_backup_pod_is_withheld_and_the_next_fault_recovers(peer_logs: Path) -> None:
    peers = find_real_peers()
    assert peers is not None
    job = RealJob(peers, peer_logs, "daemon", HarnessOptions(strategies="retry,recover,dump"))
    assert isinstance(job.entry, BridgeDaemon)
    with job:
        job.clusterd.start()
        job.clusterd.post("/pg/label", subHealthyStrategy="hotSwitch")  # read at the bridge's first Init
        assert job.agent is not None
        job.agent.start()
        job.entry.start()
        job.ranks.start()
        eventually_sync(lambda: len({e["src"] for e in job.ranks.events("registered")}) == 4, 60, "every rank up")
        job.clusterd.post("/fault/device", rank=SUB_HEALTHY_RANK, level="SubHealthFault", unhealthy=0)
        job.clusterd.wait_log(r"signalType=hot-switch", 0, 60, "the hot switch")
        job.entry.log.wait_for(r"notify do HOT switch", 0, 30, "the hot switch reaching the controller")
        job.clusterd.wait_log(r"stop switch|StopSwitch|NewPodTimeout", 0, 120, "ClusterD giving up the switch")
        eventually_sync(lambda: sample(metrics(job.entry), 'tft_bridge_controller_notifies_total{action="stop switch",'
                                       'result="withheld"}'), 30, "the stop switch withheld")
        text = metrics(job.entry)
        assert sample(text, "tft_bridge_flow_desync_total") == 0, job.dump()
        assert sample(text, "tft_bridge_signals_refused_total") == 0, job.dump()
        # a process fault the controller detects itself: it would take a latched stop
        # switch as its stop_train and exit
        job.ranks.kill([3])
        status = job.clusterd.wait_annotation("ProcessRecoverStatus", lambda v: v is not None, 180)
        assert status == "recover-success", job.dump()


@pytest.mark.parametrize("stop_switch", [True, False], ids=["stop-switch-given", "withheld"])
def test_the_real_controller_keeps_a_stop_switch_given_in_normal_for_the_next_fault(
        peer_logs: Path, stop_switch: bool) -> None:
    """Why the bridge withholds ClusterD's stop switch (bridge/job/session/signals.py STOP_SWITCH),
    on the real controller alone: after a hot switch whose replacement ranks never
    came, a stop switch sets its wake-up slot in NORMAL, and the next fault it detects
    itself ends at the first wait, at once, as an unexpected MindX action; without it,
    that wait simply waits for ClusterD's stop_train."""
    peers = find_real_peers()
    assert peers is not None
    port = free_port()
    tail = LogTail(peer_logs / "controller.log")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(peers / "mindio")]),
           "MINDIO_WAIT_MINDX_TIME": "30", "TTP_LOG_STDOUT": "1", "PYTHONUNBUFFERED": "1"}
    controller = subprocess.Popen([sys.executable, "-m", "tests.conformance.bare_controller", "--world-size", "4",
                                   "--port", str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env, start_new_session=True)
    assert controller.stdin is not None and controller.stdout is not None
    tail.follow(controller.stdout, "controller")
    ranks = Ranks(peers, 4, port, peer_logs)

    def notify(name: str, *args: object) -> None:
        mark = tail.mark()
        assert controller.stdin is not None
        controller.stdin.write(f"{name} {json.dumps(list(args))}\n")
        controller.stdin.flush()
        _, match = tail.wait_for(r'^NOTIFY (\{.*\})$', mark, 30, f"{name} returned")
        assert json.loads(match.group(1)) == {"name": name, "rc": 0}

    try:
        tail.wait_for("^READY$", 0, 60, "the controller started")
        ranks.start()
        eventually_sync(lambda: len({e["src"] for e in ranks.events("registered")}) == 4, 60, "every rank up")
        notify("prepare_action", "hot switch", {"2": 1, "3": 1})
        if stop_switch:
            notify("prepare_action", "stop switch", {})
        mark = tail.mark()
        ranks.kill([3])  # its heartbeat stops: the controller finds the fault itself
        tail.wait_for(r'^CALLBACK \{"name": "report_fault_ranks"', mark, 60, "the fault reported")
        unexpected = "mindx calling action unexpected"
        if stop_switch:
            tail.wait_for(unexpected, mark, 10, "the fault flow ended at its first wait")
        else:
            with pytest.raises(AssertionError):
                tail.wait_for(unexpected, mark, 10)
    finally:
        try:
            os.killpg(controller.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        controller.wait(10)
        ranks.close()
        tail.close()
