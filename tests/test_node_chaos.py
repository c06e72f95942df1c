"""The node entry point's invariants (tests/chaos/node.py) on made-up samples: each one
fails on the behaviour it is there to catch, so a quiet run of the fixed seeds means
something."""

from __future__ import annotations

from tests.chaos.node import NodeChaos, Sample
from tests.chaos.schedule import Event, Schedule, generate

POD = "pod-uid-1"


def verdict(*samples: Sample) -> dict[str, list[str]]:
    chaos = NodeChaos.__new__(NodeChaos)  # the checks only: no server, no services
    chaos.samples, chaos.violations, chaos.ended = list(samples), {}, {}
    chaos.check()
    return chaos.violations


def sample(at: float, pods: dict, bridges: dict, served_for: dict | None = None) -> Sample:
    return Sample(at, pods, bridges, served_for or {pid: POD for pid in bridges})


def test_two_bridges_for_one_job_on_one_node_are_named() -> None:
    found = verdict(sample(0, {"job": (POD, "node-1", True)}, {10: ("node-1", "job"), 11: ("node-1", "job")}))
    assert list(found) == ["one-bridge-per-job"] and "[10, 11]" in found["one-bridge-per-job"][0]
    # one on each node (pod 0 moved, the old one still stopping) is not that
    assert not verdict(sample(0, {"job": (POD, "node-2", True)}, {10: ("node-1", "job"), 11: ("node-2", "job")}))


def test_a_bridge_ending_under_its_running_job_is_named() -> None:
    running = {"job": (POD, "node-1", True)}
    found = verdict(sample(0, running, {10: ("node-1", "job")}), sample(1, running, {}))
    assert list(found) == ["no-stop-while-running"]
    # the pod deleted, deleting, replaced (another UID) or moved: the stop was right
    for after in ({}, {"job": (POD, "node-1", False)}, {"job": ("pod-uid-2", "node-1", True)},
                  {"job": (POD, "node-2", True)}):
        assert not verdict(sample(0, running, {10: ("node-1", "job")}), sample(1, after, {})), after


def test_settled_needs_one_bridge_on_pod_0s_node_for_its_uid() -> None:
    chaos = NodeChaos.__new__(NodeChaos)
    pods = {"job": (POD, "node-1", True)}
    assert chaos.settled(sample(0, pods, {10: ("node-1", "job")}))
    assert not chaos.settled(sample(0, pods, {}))  # no bridge
    assert not chaos.settled(sample(0, pods, {10: ("node-2", "job")}))  # on the wrong node
    assert not chaos.settled(sample(0, pods, {10: ("node-1", "job")}, {10: "old-pod"}))  # an old incarnation's
    assert not chaos.settled(sample(0, {}, {10: ("node-1", "job")}))  # a bridge for a job that is gone


def test_node_schedules_take_node_events_only_and_round_trip() -> None:
    schedule = generate(3, "node")
    assert schedule.entry == "node" and schedule.events[0].kind == "pods_added"
    assert Schedule.from_json(schedule.to_json()) == schedule
    try:
        Schedule(0, "daemon", (Event("apiserver_down", 0, args={"seconds": 1}),))
    except ValueError as error:
        assert "does not apply to the daemon entry point" in str(error)
    else:
        raise AssertionError("a node event was accepted on the daemon entry point")
