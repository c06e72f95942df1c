"""The platform agent against an in-process stand-in for the Kubernetes API server, with a
simulated ClusterD (platform mode) driving full fault cycles.

No real API server is involved: ``bridge.sim.kube.apiserver`` speaks the real HTTP
paths and semantics (list, watch, merge patch, 409, 410, restarts) on loopback, and the
official ``kubernetes`` client talks to it unmodified.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("kubernetes")

from bridge.platform.agent import AgentSettings, PlatformAgent  # noqa: E402
from bridge.platform.annotations import CONFIRM, ENABLE_LABEL, RANK_TABLE_READY, RESULT, STATUS, STRATEGY
from bridge.core.kube import api_client  # noqa: E402
from bridge.platform.podgroup_api import PodGroupApi  # noqa: E402
from bridge.platform.metrics import PlatformMetrics  # noqa: E402
from bridge.platform.policy import Policy, Rules, policy_from_dict  # noqa: E402
from bridge.sim.kube.apiserver import PodGroupStore, StandInApiServer  # noqa: E402
from bridge.sim.kube.podgroup_clusterd import CycleReport, Outcomes, SimPlatformClusterD, SimTimings  # noqa: E402
from bridge.platform.sources import StaticFaults  # noqa: E402

from .conftest import eventually  # noqa: E402

pytestmark = pytest.mark.timeout(30)

NS, JOB = "train", "job-1"
FAST = AgentSettings(resync_seconds=0.2, watch_timeout=5, backoff_initial=0.05, backoff_max=0.4,
                     source_timeout=0.25)
CANONICAL_KEYS = (CONFIRM, RESULT, RANK_TABLE_READY)


@dataclass
class Rig:
    server: StandInApiServer
    agents: list[tuple[PlatformAgent, asyncio.Task[None], PodGroupApi]] = field(default_factory=list)

    @property
    def store(self) -> PodGroupStore:
        return self.server.store

    async def start(self, policy: Policy | None = None, settings: AgentSettings = FAST,
                    **kwargs: Any) -> PlatformAgent:
        api = PodGroupApi(api_client(server=self.server.url), request_timeout=2, connect_timeout=0.5)
        agent = PlatformAgent(api, policy or Policy(), settings, PlatformMetrics(), **kwargs)
        task = asyncio.create_task(agent.run())
        self.agents.append((agent, task, api))
        assert await agent.wait_synced(5)
        return agent

    def podgroup(self, name: str = JOB, namespace: str = NS, strategy: str | None = "",
                 labels: Mapping[str, str] | None = None, **annotations: str) -> None:
        if strategy is not None:
            annotations[STRATEGY] = strategy
        self.store.create(namespace, name, annotations, {ENABLE_LABEL: "on", **(labels or {})})

    def annotations(self, name: str = JOB, namespace: str = NS) -> dict[str, str]:
        return self.store.annotations(namespace, name)

    def clusterd(self, name: str = JOB, namespace: str = NS, **timings: float) -> SimPlatformClusterD:
        return SimPlatformClusterD(self.store, namespace, name, timings=SimTimings(**timings), seed=1)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    server = StandInApiServer().start()
    rig = Rig(server)
    try:
        yield rig
    finally:
        for agent, task, api in rig.agents:
            agent.request_stop()
            started = time.monotonic()
            await asyncio.wait_for(task, 5)
            # The bound is the behaviour under test: request_stop must cut any wait short
            # (a watch can be 300 s long); a stop takes milliseconds, 3 s is load margin.
            assert time.monotonic() - started < 3, "stopping took too long"
            api.close()
        server.stop()


def settled(rig: Rig, standing: str = "dump", name: str = JOB, namespace: str = NS,
            keys: tuple[str, ...] = CANONICAL_KEYS) -> Callable[[], bool]:
    """No stale key left, and the standing strategy written again."""
    def check() -> bool:
        a = rig.annotations(name, namespace)
        return not any(k in a for k in keys) and a.get(STRATEGY) == standing
    return check


async def cycle(rig: Rig, sim: SimPlatformClusterD, faults: Mapping[int, int] | str,
                outcomes: Outcomes = Outcomes(), standing: str = "dump",
                keys: tuple[str, ...] = CANONICAL_KEYS) -> CycleReport:
    await eventually(lambda: rig.annotations(sim.name, sim.namespace).get(STRATEGY) == standing or standing == "")
    report = await asyncio.to_thread(sim.fault, faults, outcomes)
    assert report.violations == []
    await eventually(settled(rig, standing, sim.name, sim.namespace, keys))
    return report


def sample(agent: PlatformAgent, name: str, **labels: str) -> float:
    return agent.metrics.sample(name, labels)


# --------------------------------------------------------------------------- full cycles


async def test_full_cycles_retry_recover_dump(rig: Rig) -> None:
    rig.podgroup()
    agent = await rig.start()
    await eventually(lambda: rig.annotations().get(STRATEGY) == "dump")  # the standing strategy
    sim = rig.clusterd()

    retry = await cycle(rig, sim, {3: 0})
    assert (retry.code, retry.strategies, retry.statuses) == (0, ["retry"], ["retry-success"])
    assert retry.results == ["3:0"] and retry.platform_strategies == ["retry"]

    recover = await cycle(rig, sim, {3: 1, 11: 1})
    assert (recover.code, recover.strategies, recover.statuses) == (0, ["recover"], ["recover-success"])
    assert recover.rank_table == ["ready"] and recover.results == ["3:1,11:1"]

    agent.set_policy(policy_from_dict({"defaults": {"rank_table": "never"}}))
    dump = await cycle(rig, sim, {5: 1})
    assert (dump.code, dump.strategies, dump.statuses) == (0, ["dump", "exit"], ["dump-success"])
    assert dump.fault_retry

    assert rig.annotations()[STATUS] == "dump-success"  # the last status stays readable
    assert sample(agent, "tft_bridge_platform_cycles_total") == 3
    for strategy in ("retry", "recover", "dump"):
        assert sample(agent, "tft_bridge_platform_answers_total", strategy=strategy) == 1
    assert sample(agent, "tft_bridge_platform_confirm_answer_seconds_count") == 3
    clears = sum(sample(agent, "tft_bridge_platform_clears_total", reason=r) for r in ("status", "paused"))
    assert clears >= 3  # the dump's status and its FaultRetry pause come close together
    assert sample(agent, "tft_bridge_platform_strategies_written_total", strategy="dump", reason="standing") >= 3
    assert sample(agent, "tft_bridge_platform_recover_statuses_total", status="recover-success") == 1
    assert sample(agent, "tft_bridge_platform_podgroups") == 1


async def test_a_405_retry_failure_is_confirmed_again_without_retry(rig: Rig) -> None:
    rig.podgroup()
    await rig.start()
    report = await cycle(rig, rig.clusterd(), {2: 0}, Outcomes(retry="failed-405"))
    assert report.statuses == ["retry-failed", "recover-success"]
    assert report.platform_strategies == ["retry", "recover"]  # the second answer knew
    assert len(report.confirms) == 2  # the confirm was cleared in time for the second one


async def test_failed_retry_then_exit_is_cleared_on_the_pause(rig: Rig) -> None:
    rig.podgroup()
    agent = await rig.start()
    report = await cycle(rig, rig.clusterd(), {2: 0}, Outcomes(retry="failed"))
    assert report.strategies == ["retry", "exit"] and report.statuses == ["retry-failed"]
    assert report.fault_retry
    await eventually(lambda: STATUS not in rig.annotations())  # an interim status does not outlive the cycle
    assert sample(agent, "tft_bridge_platform_clears_total", reason="paused") >= 1


async def test_failed_recover_then_exit(rig: Rig) -> None:
    rig.podgroup()
    await rig.start()
    report = await cycle(rig, rig.clusterd(), {6: 1}, Outcomes(recover="failed"))
    assert report.strategies == ["recover", "exit"] and report.statuses == ["recover-failed"]
    await eventually(lambda: STATUS not in rig.annotations())


async def test_rank_table_external(rig: Rig) -> None:
    rig.podgroup()
    await rig.start(policy_from_dict({"defaults": {"rank_table": "external"}}))
    sim = rig.clusterd()
    no_table = await cycle(rig, sim, {1: 1})
    assert no_table.platform_strategies == ["dump"]
    rig.store.patch_annotations(NS, JOB, {RANK_TABLE_READY: "true"})  # the platform's rank-table service
    with_table = await cycle(rig, sim, {1: 1}, keys=(CONFIRM, RESULT))
    assert with_table.platform_strategies == ["recover"] and with_table.statuses == ["recover-success"]
    assert rig.annotations().get(RANK_TABLE_READY) == "true"  # not the agent's key in this mode


# --------------------------------------------------------------------------- malformed input


NASTY_CONFIRMS = [
    "4:1, 2:1",  # poisons ClusterD: no ranks at all
    " 1:0,,2:0,bad,7,1:1:1 ",
    "1:9,2:0",
    "x:y",
    ",,,",
    "99999999999999999999:1,3:0",
    "3:0,3:1,3:0",
    "\u00a05:1,٣:1",
]


async def test_malformed_confirms_never_produce_a_malformed_annotation(rig: Rig) -> None:
    rig.podgroup()
    agent = await rig.start()
    sim = rig.clusterd()
    for text in NASTY_CONFIRMS:
        report = await cycle(rig, sim, text)
        assert report.violations == [], text
        for written in report.results:
            assert written == "" or __import__("re").fullmatch(r"\d+:[012](,\d+:[012])*", written), written
    assert sample(agent, "tft_bridge_platform_malformed_annotations_total",
                  key=CONFIRM, kind="poisoned") == 4
    assert sample(agent, "tft_bridge_platform_malformed_annotations_total", key=CONFIRM, kind="dropped") >= 3
    assert sample(agent, "tft_bridge_platform_malformed_annotations_total", key=CONFIRM, kind="rejected") >= 1


async def test_a_poisoned_confirm_is_answered_with_dump(rig: Rig) -> None:
    rig.podgroup()
    await rig.start()
    report = await cycle(rig, rig.clusterd(), "4:1, 2:1")
    assert report.results == ["4:1"] and report.platform_strategies == ["dump"]
    assert report.poisoned == [True]  # ClusterD's own copy still poisons its merge


# --------------------------------------------------------------------------- concurrency


async def test_a_conflict_is_re_read_and_the_other_change_kept(rig: Rig) -> None:
    rig.podgroup()
    agent = await rig.start()
    await eventually(lambda: rig.annotations().get(STRATEGY) == "dump")
    touched = threading.Event()

    def concurrent(namespace: str, name: str, body: Any) -> None:
        if RESULT in body["metadata"]["annotations"] and not touched.is_set():
            touched.set()
            rig.store.patch_annotations(namespace, name, {"other.example/owner": "someone"})

    rig.server.before_write = concurrent
    report = await cycle(rig, rig.clusterd(), {4: 0})
    assert touched.is_set() and report.statuses == ["retry-success"]
    assert rig.annotations()["other.example/owner"] == "someone"
    assert sample(agent, "tft_bridge_platform_conflicts_total") == 1


async def test_a_conflict_that_changes_the_decision(rig: Rig) -> None:
    """The agent is about to write its standing strategy when ClusterD's confirm lands:
    the write is refused, and the re-read turns the step into an answer."""
    rig.podgroup()
    fired = threading.Event()

    def confirm_lands(namespace: str, name: str, body: Any) -> None:
        if not fired.is_set():
            fired.set()
            rig.store.patch_annotations(namespace, name, {CONFIRM: "8:0", STRATEGY: "dump"})

    rig.server.before_write = confirm_lands
    agent = await rig.start()
    await eventually(lambda: RESULT in rig.annotations())
    assert rig.annotations()[RESULT] == "8:0" and rig.annotations()[STRATEGY] == "retry"
    assert sample(agent, "tft_bridge_platform_conflicts_total") == 1


async def test_two_agents_never_overwrite_each_other(rig: Rig) -> None:
    rig.podgroup()
    first = await rig.start()
    second = await rig.start()
    sim = rig.clusterd()
    for faults in ({1: 0}, {2: 1}, {3: 0}):
        report = await cycle(rig, sim, faults)
        assert report.code == 0 and len(report.confirms) == 1
    answers = sum(sample(a, "tft_bridge_platform_answers_total", strategy=s)
                  for a in (first, second) for s in ("retry", "recover"))
    assert answers == 3  # one answer per confirm: the loser of each race got a 409


# --------------------------------------------------------------------------- watch and API failures


async def test_watch_expiry_relists(rig: Rig) -> None:
    rig.podgroup()
    agent = await rig.start()
    sim = rig.clusterd()
    await cycle(rig, sim, {1: 0})
    rig.store.compact()
    rig.store.expire_watches()
    await eventually(lambda: sample(agent, "tft_bridge_platform_watch_restarts_total", reason="expired") >= 1)
    report = await cycle(rig, sim, {1: 1})
    assert report.statuses == ["recover-success"]


async def test_http_410_on_rewatch_relists(rig: Rig) -> None:
    rig.server.expire_mode = "http"
    rig.podgroup()
    settings = AgentSettings(resync_seconds=0.2, watch_timeout=1, backoff_initial=0.05, backoff_max=0.4)
    agent = await rig.start(settings=settings)
    await eventually(lambda: rig.annotations().get(STRATEGY) == "dump")
    rig.server.expire_next_watch()  # the re-watch after the server's 1 s timeout gets HTTP 410
    await eventually(lambda: sample(agent, "tft_bridge_platform_watch_restarts_total", reason="expired") >= 1, 4)
    report = await cycle(rig, rig.clusterd(), {2: 0})
    assert report.statuses == ["retry-success"]


@pytest.mark.parametrize("how", ["killed", "graceful"])
async def test_api_server_restart_during_a_cycle(rig: Rig, how: str) -> None:
    rig.podgroup()
    agent = await rig.start()
    await eventually(lambda: rig.annotations().get(STRATEGY) == "dump")
    sim = rig.clusterd(wait=4.0)
    if how == "killed":
        await asyncio.to_thread(rig.server.stop)  # every connection dropped at once
    else:  # SIGTERM: new requests refused, the open watch held (and fed) until the process ends
        rig.server.terminate(1.0)
    fault = asyncio.create_task(asyncio.to_thread(sim.fault, {9: 1}))
    # ClusterD (in-process, not through HTTP) writes its confirm while the server is down
    await eventually(lambda: CONFIRM in rig.annotations(), what="the confirm written while the API server is down")
    await asyncio.to_thread(rig.server.start)  # back on the same port (after a graceful stop: once it ended)
    report = await fault
    assert report.violations == [] and report.statuses == ["recover-success"]
    await eventually(settled(rig))
    assert sample(agent, "tft_bridge_platform_watch_restarts_total", reason="error") >= 1


class WatchBug(BaseException):
    """What the watch loop does not catch: its thread dies."""


class DyingWatchApi:
    def list(self, namespace: str | None, selector: str | None) -> tuple[list[dict[str, Any]], str]:
        raise WatchBug("the list loop itself failed")


async def test_a_dying_watch_thread_stops_the_agent_with_its_failure() -> None:
    agent = PlatformAgent(DyingWatchApi(), Policy(), FAST, PlatformMetrics())  # type: ignore[arg-type]
    assert await asyncio.wait_for(agent.run(), 10) == 1  # no request_stop: the watch's death ends it
    assert agent.failure is not None and "watch thread failed" in agent.failure


# --------------------------------------------------------------------------- start-up, scope, policy


async def test_stale_keys_found_at_start_up(rig: Rig) -> None:
    rig.podgroup("finished", strategy="recover", ProcessConfirmFault="1:1", ProcessResultFault="1:1",
                 RankTableReady="true", ProcessRecoverStatus="recover-success")
    rig.podgroup("orphan-result", ProcessResultFault="2:1")
    rig.podgroup("waiting", strategy="dump", ProcessConfirmFault="3:0")
    rig.podgroup("not-platform", strategy=None, ProcessConfirmFault="4:1")
    agent = await rig.start()
    await eventually(settled(rig, name="finished"))
    await eventually(settled(rig, name="orphan-result"))
    await eventually(lambda: rig.annotations("waiting").get(RESULT) == "3:0")
    assert rig.annotations("not-platform") == {CONFIRM: "4:1"}
    assert sample(agent, "tft_bridge_platform_clears_total", reason="stale_result") == 1
    assert sample(agent, "tft_bridge_platform_podgroups") == 3


async def test_namespace_and_selector_scope(rig: Rig) -> None:
    rig.podgroup("mine", namespace="a", labels={"managed": "yes"})
    rig.podgroup("unlabelled", namespace="a")
    rig.podgroup("elsewhere", namespace="b", labels={"managed": "yes"})
    agent = await rig.start(settings=AgentSettings(namespace="a", selector="managed=yes", resync_seconds=0.2))
    await eventually(lambda: rig.annotations("mine", "a")[STRATEGY] == "dump")
    # The agent's whole world after its first list: the one PodGroup in scope (it acts on
    # nothing else, resyncs included).
    assert sample(agent, "tft_bridge_platform_podgroups") == 1
    assert rig.annotations("unlabelled", "a")[STRATEGY] == ""
    assert rig.annotations("elsewhere", "b")[STRATEGY] == ""
    assert all("/namespaces/a/" in path for method, path, _ in rig.server.requests if method == "PATCH")


async def test_hold_policy_leaves_the_strategy_to_someone_else(rig: Rig) -> None:
    rig.podgroup()
    agent = await rig.start(Policy(Rules(standing_strategy="")))
    sim = rig.clusterd(wait=0.3)
    timeout = await asyncio.to_thread(sim.fault, {1: 0})
    assert timeout.code == 508 and rig.annotations()[STRATEGY] == ""
    # The next fault waits (long enough that only the release can end it) until the
    # operator releases it: before or during its wait, the outcome is the same.
    held = rig.clusterd(wait=10)
    fault = asyncio.create_task(asyncio.to_thread(held.fault, {1: 0}))
    rig.store.patch_annotations(NS, JOB, {STRATEGY: "dump"})  # the operator releases the fault
    report = await fault
    assert report.statuses == ["retry-success"]  # the agent's answer still decides
    await eventually(settled(rig, standing=""))
    assert sample(agent, "tft_bridge_platform_strategies_written_total", strategy="dump", reason="standing") == 0


async def test_a_cycle_whose_end_is_never_seen_is_cleared_after_stale_after(rig: Rig) -> None:
    rig.podgroup()
    settings = AgentSettings(resync_seconds=0.1, stale_after=0.3, watch_timeout=5)
    agent = await rig.start(settings=settings)
    rig.store.patch_annotations(NS, JOB, {CONFIRM: "5:1"})  # and ClusterD is never heard of again
    await eventually(lambda: RESULT in rig.annotations())
    await eventually(settled(rig), 3)
    assert sample(agent, "tft_bridge_platform_clears_total", reason="timeout") == 1


async def test_podgroup_deleted_and_recreated(rig: Rig) -> None:
    rig.podgroup()
    await rig.start()
    await eventually(lambda: rig.annotations().get(STRATEGY) == "dump")
    rig.store.delete(NS, JOB)
    rig.podgroup()
    await eventually(lambda: rig.annotations().get(STRATEGY) == "dump")
    report = await cycle(rig, rig.clusterd(), {1: 0})
    assert report.statuses == ["retry-success"]


# --------------------------------------------------------------------------- fault sources


async def test_platform_faults_are_merged_into_the_answer(rig: Rig) -> None:
    rig.podgroup()
    await rig.start(fault_source=StaticFaults({(NS, JOB): {7: 1, 3: 2}}))
    report = await cycle(rig, rig.clusterd(), {3: 0})
    assert report.results == ["3:2,7:1"]  # a rank added, HCCL over UCE (the later wins)
    assert report.platform_strategies == ["recover"]  # no longer retryable
    assert report.merged == [{3: 0, 7: 1}]  # ClusterD's own merge: its confirm comes last


class _Broken:
    def __init__(self, how: str) -> None:
        self.how = how

    async def faults(self, namespace: str, name: str, confirmed: Mapping[int, int]) -> Any:
        if self.how == "slow":
            await asyncio.sleep(10)  # the slowness is the behaviour under test (source_timeout is 0.25 s)
        if self.how == "bad":
            return {"x": 1}
        raise RuntimeError("inventory service down")


@pytest.mark.parametrize("how", ["raise", "slow", "bad"])
async def test_a_failing_fault_source_does_not_stop_the_answer(rig: Rig, how: str) -> None:
    rig.podgroup()
    agent = await rig.start(fault_source=_Broken(how))
    report = await cycle(rig, rig.clusterd(), {3: 0})
    assert report.results == ["3:0"] and report.statuses == ["retry-success"]
    assert sample(agent, "tft_bridge_platform_fault_source_errors_total") == 1


def test_sync_fault_sources_run_in_a_thread() -> None:
    from bridge.platform.sources import ask, load_fault_source

    class Sync:
        def faults(self, namespace: str, name: str, confirmed: Mapping[int, int]) -> dict[int, int]:
            assert threading.current_thread() is not threading.main_thread()
            return {1: 1}

    assert asyncio.run(ask(Sync(), "a", "b", {}, 1.0)) == {1: 1}
    assert isinstance(load_fault_source("bridge.platform.sources:StaticFaults"), StaticFaults)
    assert load_fault_source(None).__class__.__name__ == "NoFaults"
    for bad in ("nonsense", "bridge.platform.sources:Missing", "json:dumps"):
        with pytest.raises(ValueError):
            load_fault_source(bad)


async def test_stop_interrupts_a_long_watch(rig: Rig) -> None:
    rig.podgroup()
    agent = await rig.start(settings=AgentSettings(watch_timeout=300))
    await eventually(lambda: agent.metrics.sample("tft_bridge_platform_watch_up") == 1)
    await eventually(lambda: rig.store.watcher_count >= 1, what="the long watch open on the server")
    # the rig's teardown stops it and asserts it took well under the watch's 300 s


async def test_removing_the_strategy_key_ends_management(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    rig.podgroup()
    agent = await rig.start()
    await eventually(lambda: rig.annotations().get(STRATEGY) == "dump")
    rig.store.patch_annotations(NS, JOB, {STRATEGY: None})
    await eventually(lambda: agent.metrics.sample("tft_bridge_platform_podgroups") == 0)
    assert "no longer managed" in caplog.text
    rig.store.patch_annotations(NS, JOB, {CONFIRM: "1:1"})
    # A barrier instead of a sleep: the watch delivers events in order, so once a PodGroup
    # created after the confirm is managed (its standing strategy written), the agent has
    # taken in the confirm too; the gauge says it manages only that new one.
    rig.podgroup(name="after-the-confirm")
    await eventually(lambda: rig.annotations("after-the-confirm").get(STRATEGY) == "dump",
                     what="a PodGroup created after the confirm managed")
    assert agent.metrics.sample("tft_bridge_platform_podgroups") == 1
    assert RESULT not in rig.annotations() and STRATEGY not in rig.annotations()


async def test_late_write_answers_never_replace_newer_versions() -> None:
    """A write's answer that comes back after the watch delivered a newer version, or
    the PodGroup's deletion and re-creation, must not roll the cache back."""
    agent = PlatformAgent(api=None, policy=Policy())  # type: ignore[arg-type]

    def obj(uid: str, rv: str, **annotations: str) -> dict[str, Any]:
        return {"metadata": {"namespace": NS, "name": JOB, "uid": uid, "resourceVersion": rv,
                             "annotations": {STRATEGY: "dump", **annotations}}}

    from bridge.platform.annotations import PodGroupView as View

    agent._ingest(View.from_object(obj("old", "10")))
    agent._ingest(View.from_object(obj("old", "12", ProcessRecoverStatus="retry-success")))
    agent._ingest(View.from_object(obj("old", "11", ProcessResultFault="1:0")), from_watch=False)
    assert agent._cache[(NS, JOB)].resource_version == "12"
    agent._forget((NS, JOB))  # DELETED
    agent._ingest(View.from_object(obj("old", "13")), from_watch=False)  # a late answer
    assert (NS, JOB) not in agent._cache
    agent._ingest(View.from_object(obj("new", "14")))  # re-created
    agent._ingest(View.from_object(obj("old", "13")), from_watch=False)
    assert agent._cache[(NS, JOB)].uid == "new"
