"""One scenario, two drivers: the real peers and the simulations, compared step by step.

The simulations (``bridge/sim``: the simulated ClusterD, the stub controller) earn trust
only by doing what the real peers do, so every scenario here runs twice, side by side:
once on the real peers (tests/conformance/realjob.py: ClusterD's service code in the
harness, a real MindIO TFT build hosted by ``tft-bridge run``, fake ranks on the real
processor library, the node agent) and once on the simulations
(``bridge.sim.scenario.SimulatedJob``: the simulated ClusterD of the same release, the
stub controller, simulated ranks, the same bridge). Each run is read back as a
tests/conformance/transcript.py ``Transcript``, and ``differences`` compares, side by
side:

* ClusterD's: the RPCs it received in order (fault ranks, the status code of each
  report, the strategies offered, the strategy of each result), the signals it sent
  (type, fault ranks, strategy; keep-alives left out), the ``ProcessRecoverStatus`` it
  wrote, each closed cycle's state path, and in platform mode its PodGroup exchange
  (the platform's strategy it read, 508/509, the faults it merged, the rank table);
* the controller's: its callbacks (fault ranks, codes, strategies, the strategy list it
  offered) and the notifies it was given (``change_strategy`` with its strategy);
* the bridge's own record: its RPCs with ClusterD's answer codes, the signals, the
  notifies with the controller's return codes, the outcomes;
* how the entry ended (its exit code), and the PodGroup annotations the scenario names
  (``ProcessConfirmFault``) as they are at the end;
* the platform's writes (a scenario in platform mode), each with how many signals
  ClusterD had sent by then: a ClusterD that went on without the platform shows there.

What legitimately differs is left out of the comparison: uuids, times, ports, free
text, and ClusterD's ``choose strategy`` line (the simulation logs no decision apart
from its changeStrategy signal, which is compared). The simulation runs on clocks ten
times faster (``SIM_SCALE``, ClusterD's and the stub's alike, every ratio kept, with
margins of tenths of a second where a real peer races two of its timers: a rank killed
at the stop-complete is silent past the heartbeat loss, 0.8 s, when the globalFault
comes, 1.1 s later): the order of things is what is compared, never their times; the
simulation waits beside the real run, so its clock costs no wall time. Some delays keep
their real length:
ClusterD's 20 s of schedule checks and 80 s between its two exit notices after an exit,
which a bridge whose controller has ended outruns (it exits first) on the real peers,
and must on the simulation too; and the
controller's wait for each ClusterD decision (``MINDIO_WAIT_MINDX_TIME``, read by the
stub as by the real one), which a ClusterD outage of real seconds must fit in.

A scenario is data (``Scenario``): the fault (rank, kind), ranks killed at start or
after ClusterD received the stop-complete, a ClusterD outage at the stop-complete, an
idle time before the fault, the strategies the PodGroup allows and its other
annotations (platform mode), what the platform writes and when, how many cycles ClusterD
closes on each release, whether the entry ends by itself. The two drivers
(``run_real``, ``run_sim``) play the same definition.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bridge.core.config import ClusterDConfig
from bridge.sim import mindio_ttp
from bridge.sim.clusterd import SimJob
from bridge.sim.clusterd_release import RELEASES
from bridge.sim.clusterd_timings import REAL
from bridge.sim.journal import Journal, JournalEntry
from bridge.sim.mindio_ttp import Record, State
from bridge.sim.scenario import SimulatedJob, free_port

from ..conftest import eventually, eventually_sync
from . import transcript as tr
from .peers import HarnessOptions, _history
from .realjob import RealJob

#: The simulated ClusterD release that plays each harness binary's release.
SIM_RELEASE = {"master": "master", "7.3.2": "7.3"}
#: fake_rank.py's FAULT_KIND and the fault type the controller reports for it.
FAULT_TYPES = {"uce": 0, "unknown": 1, "hccl": 2}
#: ClusterD's keep-alive interval on the signal stream in both runs (harness -keepalive).
KEEPALIVE = 1
#: The bridge's [clusterd] settings on the simulation: as on the real peers (BridgeDaemon),
#: every default but ClusterD's keep-alive cadence (SimulatedJob shortens the others).
CLUSTERD_SETTINGS = {**{key: getattr(ClusterDConfig(), key) for key in
                        ("rpc_timeout", "grpc_keepalive", "reconnect_initial", "reconnect_max", "recheck_disabled",
                         "startup_wait")},
                     "keepalive_interval": KEEPALIVE}
#: A real recovery's bound: a type-1 fault is seen 2 s after the rank raises, its
#: globalFault comes 11 s after the stop, the repair takes seconds; a loaded machine doubles it.
REAL_BOUND = 120.0
#: The simulated recovery's bound (scaled clocks).
SIM_BOUND = 60.0
#: How much faster the simulation's clocks run than the real peers'.
SIM_SCALE = 0.1
#: The simulated ClusterD's clock: scaled, but for what races with the bridge's own real
#: seconds after an exit (the bridge whose controller ended exits within them): the 20 s
#: of schedule checks and the 80 s to the second exit notice.
SIM_TIMINGS = REAL.scaled(SIM_SCALE, schedule_check=REAL.schedule_check, dump_exit_repeat=REAL.dump_exit_repeat,
                          keepalive_interval=float(KEEPALIVE))
#: The stub controller's clock, scaled alike.
STUB_TIMINGS = {name: value * SIM_SCALE for name, value in mindio_ttp.REAL_TIMINGS.items()}
#: Quiet time on the simulation after its end: a late report the real peers would make
#: within 15 s comes within this on the scaled clocks.
SIM_SETTLE = 15.0 * SIM_SCALE


#: The moments a scenario acts at, as each side sees them: a line of the real ClusterD's
#: log, an entry of the simulated one's journal.
MOMENTS: dict[str, tuple[str, Callable[[JournalEntry], bool]]] = {
    "stop-complete": (r"receive ReportStopComplete",
                      lambda e: e.kind == "rpc" and e.name == "ReportStopComplete"),
    "global-fault": (r"signal enqueue, .*signalType=globalFault",
                     lambda e: e.kind == "signal" and e.name == "globalFault"),
    "strategy": (r"signal enqueue, .*signalType=changeStrategy",
                 lambda e: e.kind == "signal" and e.name == "changeStrategy"),
    # platform mode: ClusterD at a fault, waiting for the platform's strategy
    "plat-wait": (r"start wait plat strategy ready",
                  lambda e: e.kind == "platform" and e.name == "wait-strategy"),
    # platform mode: ClusterD refusing the confirm step (509), FaultRetry next
    "plat-509": (r"write confirm fault or wait plat result fault timeout|interacte with plat error",
                 lambda e: e.kind == "platform" and e.name == "confirm-failed"),
}


@dataclass(frozen=True)
class PlatformWrite:
    """The AI platform writing PodGroup annotations (the harness's ``POST /pg/annotate``,
    ``SimClusterD.platform_annotate``) ``after`` seconds (real; scaled on the
    simulation) past a moment (a ``MOMENTS`` key)."""

    at: str
    after: float
    annotations: Mapping[str, str]

    def text(self) -> str:
        return ",".join(f"{key}={value}" for key, value in self.annotations.items())


@dataclass(frozen=True)
class Scenario:
    """One conformance scenario, as both drivers play it."""

    name: str
    strategies: str = "retry,recover,dump"  # the PodGroup's recover-strategy annotation
    fault_rank: int = -1  # the rank that raises at ``fault_step`` (its training step)
    fault_kind: str = "none"  # fake_rank.py's FAULT_KIND: uce, hccl, unknown (a process fault)
    kill_ranks: tuple[int, ...] = ()  # killed -9 (no fault raised) ...
    kill_at: str = "start"  # ... once every rank trains ("start"), or at a MOMENTS key
    clusterd_outage: float = 0.0  # ClusterD killed at the stop-complete, back on its port after this
    idle: float = 0.0  # seconds the job trains untouched before the fault (keep-alive pings)
    node_agent: bool = True  # MindCluster's node agent restarts the ranks ClusterD names
    cycles: Mapping[str, int] = field(default_factory=dict)  # cycles ClusterD closes, per release (1)
    ends_at: str = ""  # a MOMENTS key when the scenario's cycle never closes (read then, after settle)
    entry_exits: bool = False  # the entry ends by itself (the controller ended: exit strategy)
    settle: float = 3.0  # quiet seconds on the real peers after the end: what comes late is compared too
    wait_mindx_time: int = 20  # MINDIO_WAIT_MINDX_TIME, on both
    releases: tuple[str, ...] = ("master",)  # the harness releases it runs against
    # the PodGroup's other annotations at creation: ProcessRecoverStrategy turns platform mode on
    podgroup: Mapping[str, str] = field(default_factory=dict)
    platform_writes: tuple[PlatformWrite, ...] = ()  # what the platform writes, and when
    compared_annotations: tuple[str, ...] = ()  # PodGroup annotations both sides must end with

    def cycles_on(self, release: str) -> int:
        return self.cycles.get(release, 1)

    @property
    def fault_step(self) -> int:
        """The step the fault rank raises at: six steps of 0.2 s in, plus the idle time."""
        return 6 + int(self.idle / 0.2)


SCENARIOS: tuple[Scenario, ...] = (
    # A UCE on rank 2: a retry. On v7.3.2 the fault centre repeats the cycle after the
    # success, and the healthy controller fails its device stop (499).
    Scenario("uce-retry", fault_rank=2, fault_kind="uce", releases=("master", "7.3.2"),
             cycles={"7.3.2": 2}),
    # An HCCL failure on rank 1: a retry after ClusterD's 3 s HCCL pause; v7.3.2 repeats
    # it 4 s after the success.
    Scenario("hccl-retry", fault_rank=1, fault_kind="hccl", releases=("master", "7.3.2"), cycles={"7.3.2": 2}),
    # A process fault on rank 2: ClusterD widens it to the pod (2, 3), the node agent
    # restarts both, the recover succeeds.
    Scenario("process-recover", fault_rank=2, fault_kind="unknown", releases=("master", "7.3.2")),
    # A process fault on rank 1: rank 0's pod restarted under a controller outside it.
    Scenario("rank0-pod-recover", fault_rank=1, fault_kind="unknown"),
    # Rank 3 killed on a job allowing only retry: ClusterD has only exit left, the
    # daemon ends (76) once the controller gave the job up.
    Scenario("rank-killed-exit", strategies="retry", kill_ranks=(3,), node_agent=False, entry_exits=True),
    # ClusterD killed -9 at the stop-complete of a process fault, back 3 s later on its
    # port with none of the cycle: the bridge re-subscribes and the recover succeeds.
    Scenario("clusterd-restart", fault_rank=2, fault_kind="unknown", clusterd_outage=3.0, wait_mindx_time=30,
             releases=("master", "7.3.2")),
    # Rank 0 killed at the stop-complete of rank 2's process fault: silent for the 11 s
    # until the globalFault, it is in the controller's second fault report (heartbeats
    # lost for 8 s), and the recover waits for it, but the node agent restarts only the
    # ranks ClusterD named at the globalFault (2, 3): the cycle never closes.
    Scenario("rank-killed-at-stop-complete", fault_rank=2, fault_kind="unknown", kill_ranks=(0,),
             kill_at="stop-complete", ends_at="strategy"),
    # Rank 0 killed at the globalFault, after the controller's second fault report: the
    # recover of 2 and 3 succeeds, and the real controller never reports rank 0, not in
    # the 15 s after it is back in NORMAL.
    Scenario("rank-killed-at-global-fault", fault_rank=2, fault_kind="unknown", kill_ranks=(0,),
             kill_at="global-fault", settle=15.0),
    # Seed 003's platform mode: ProcessRecoverStrategy empty, ProcessResultFault empty. At
    # rank 2's process fault ClusterD sends nothing while it polls (every 3 s) for the
    # platform's strategy; 6 s later the platform writes recover and RankTableReady=true;
    # ClusterD confirms 2:1 in ProcessConfirmFault, and the recover of 2 and 3 succeeds.
    Scenario("platform-recover", fault_rank=2, fault_kind="unknown", releases=("master", "7.3.2"),
             podgroup={"ProcessRecoverStrategy": "", "ProcessResultFault": ""},
             platform_writes=(PlatformWrite("plat-wait", 6.0, {"ProcessRecoverStrategy": "recover",
                                                               "RankTableReady": "true"}),),
             compared_annotations=("ProcessConfirmFault",)),
    # Platform mode with the last fault's ProcessConfirmFault never cleared (the platform's
    # strategy recover already written): ClusterD stops the job at rank 2's process fault,
    # then refuses to confirm (509) and ends in FaultRetry (a dump_exit, no globalFault).
    # The platform clears the confirm and readies the rank table 2 s after the refusal;
    # the bridge re-reports the fault to the reset job, the second cycle confirms 2:1 and
    # the recover succeeds. The controller waits out both cycles (60 s; 20 s would expire
    # before the second globalFault).
    Scenario("platform-confirm-not-cleared", fault_rank=2, fault_kind="unknown", wait_mindx_time=60,
             releases=("master", "7.3.2"),
             podgroup={"ProcessRecoverStrategy": "recover", "ProcessResultFault": "", "ProcessConfirmFault": "1:1"},
             platform_writes=(PlatformWrite("plat-509", 2.0, {"ProcessConfirmFault": "", "RankTableReady": "true"}),),
             cycles={"master": 2, "7.3.2": 2}, compared_annotations=("ProcessConfirmFault",)),
    # The bridge idle past three of its pings (every 30 s, its default), then a UCE: on
    # v7.3.2 (gRPC's default ping policy: the third strike draws GOAWAY) no GOAWAY, so
    # one subscription until the cycle.
    Scenario("idle-keepalive", fault_rank=2, fault_kind="uce", idle=100.0, releases=("7.3.2",),
             cycles={"7.3.2": 2}),
)


def cases() -> list[tuple[Scenario, str]]:
    """Every (scenario, harness release) pair the differential runs."""
    return [(scenario, release) for scenario in SCENARIOS for release in scenario.releases]


# --------------------------------------------------------------------------- the real peers
#: how often a predicate that reads a whole log is asked again
LOG_POLL = 0.2


def _closed_cycles(job: RealJob) -> int:
    return len([s for s in tr.clusterd_steps(job.clusterd.log.lines(), job.options.release) if s.kind == "cycle"])


def run_real(scenario: Scenario, release: str, peers: Path, workdir: Path) -> tr.Transcript:
    """The scenario on the real peers (``tft-bridge run`` hosting the real controller),
    read back once ClusterD closed the scenario's cycles (or reached ``ends_at``) and
    ``settle`` quiet seconds passed; the entry is then stopped (SIGTERM) unless it ended
    by itself."""
    podgroup = dict(scenario.podgroup)  # the platform's two keys have flags of their own
    options = HarnessOptions(job_uid=f"differential-{scenario.name}", strategies=scenario.strategies,
                             keepalive=KEEPALIVE, release=release, platform=podgroup.pop("ProcessRecoverStrategy", None),
                             plat_result=podgroup.pop("ProcessResultFault", None), annotations=podgroup)
    # A port outside the kernel's ephemeral range when the restart reuses it.
    port = free_port() if scenario.clusterd_outage else 0
    job = RealJob(peers, workdir, "daemon", options, wait_mindx_time=scenario.wait_mindx_time, clusterd_port=port,
                  node_agent=scenario.node_agent)
    try:
        job.start(fault_rank=scenario.fault_rank, fault_step=scenario.fault_step,
                  fault_kind=scenario.fault_kind if scenario.fault_rank >= 0 else "none")
        if scenario.kill_ranks and scenario.kill_at == "start":
            job.ranks.kill(scenario.kill_ranks)
        elif scenario.kill_ranks:
            job.clusterd.wait_log(MOMENTS[scenario.kill_at][0], 0, REAL_BOUND, f"ClusterD's {scenario.kill_at}")
            job.ranks.kill(scenario.kill_ranks)
        written: list[tr.Step] = []
        for write in scenario.platform_writes:
            job.clusterd.wait_log(MOMENTS[write.at][0], 0, REAL_BOUND, f"ClusterD's {write.at}")
            time.sleep(write.after)  # the platform's delay is the behaviour under test
            sent = [s for s in tr.clusterd_steps(job.clusterd.log.lines(), release) if s.kind == "signal"]
            job.clusterd.post("/pg/annotate", **write.annotations)
            written.append(_platform_step(write, len(sent)))
        if scenario.clusterd_outage:
            job.clusterd.wait_log(MOMENTS["stop-complete"][0], 0, REAL_BOUND, "the stop-complete at ClusterD")
            job.clusterd.kill()
            time.sleep(scenario.clusterd_outage)  # the outage is the behaviour under test
            job.clusterd.start()
        if scenario.ends_at:
            job.clusterd.wait_log(MOMENTS[scenario.ends_at][0], 0, REAL_BOUND, f"ClusterD's {scenario.ends_at}")
        else:
            cycles = scenario.cycles_on(release)
            eventually_sync(lambda: _closed_cycles(job) >= cycles, REAL_BOUND + scenario.idle,
                            f"ClusterD closing {cycles} cycle(s)", interval=LOG_POLL)
        if scenario.entry_exits:
            job.entry.wait_exit(REAL_BOUND)
        time.sleep(scenario.settle)  # the quiet time is the behaviour under test: nothing late may come
        transcript = job.transcript()
        transcript.steps = sorted([*transcript.steps, *written], key=lambda s: s.at)
        transcript.annotations = {key: job.clusterd.annotation(key) for key in scenario.compared_annotations}
        if not scenario.entry_exits:
            transcript.exit_code = job.entry.terminate(timeout=70)
        return transcript
    except Exception as error:  # the real run's own failure, with what it had seen
        raise AssertionError(f"the real run of {scenario.name} on {release} failed: {error}\n{job.dump()}") from error
    finally:
        job.close()


def _platform_step(write: PlatformWrite, signals_before: int) -> tr.Step:
    """The platform's write as a step of the transcript, with the signals ClusterD had
    sent by then (keep-alives left out)."""
    return tr.Step("platform", "annotate", write.text(), detail=f"after {signals_before} signal(s)",
                   at=time.monotonic())


# --------------------------------------------------------------------------- the simulations
async def _node_agent(job: SimulatedJob) -> None:
    """MindCluster's node agent on the simulation: at each recover, the ranks ClusterD
    named (its globalFault's, the real one's faultList) restarted, once the stub's repair
    waits for them. The stub's own agent (``training.auto_restart``) restarts the pods
    of the ranks the controller found dead instead, which is not what the real one does
    when the two differ."""
    journal, training = job.sim.journal, job.training
    handled = 0
    while True:
        recovers = [e for e in journal.signals("changeStrategy") if e.detail.get("changeStrategy") == "recover"]
        if len(recovers) > handled:
            handled = len(recovers)
            named = [e for e in journal.signals("globalFault") if e.seq < recovers[-1].seq]
            await eventually(lambda: training.state is State.REPAIR, SIM_BOUND, "the stub repairing")
            training.restart_pods(dict(named[-1].detail.get("faults") or {}) if named else ())
        await asyncio.sleep(0.01)  # polling the journal, a list in this process


async def run_sim(scenario: Scenario, release: str, workdir: Path) -> tr.Transcript:
    """The same scenario on the simulated ClusterD of ``release`` and the stub controller
    (the bridge in process), on scaled clocks."""
    strategies = tuple(scenario.strategies.split(","))
    spec = SimJob(f"differential-{scenario.name}", world_size=4, devices_per_pod=2, strategies=strategies,
                  annotations=dict(scenario.podgroup))
    recorder = workdir / "sim-recorder"
    timings = SIM_TIMINGS
    job = SimulatedJob(spec, keepalive_interval=KEEPALIVE, clusterd_timings=timings,
                       global_fault_delay=timings.global_fault_delay, flush_delay=timings.flush_delay,
                       dump_exit_repeat=timings.dump_exit_repeat,
                       controller_timings=STUB_TIMINGS, wait_time=scenario.wait_mindx_time,
                       release=RELEASES[SIM_RELEASE[release]],
                       config_overrides={"clusterd": dict(CLUSTERD_SETTINGS),
                                         "recorder": {"enabled": True, "directory": str(recorder)}})
    journal = job.sim.journal
    exit_code: int | None = None
    agent: asyncio.Task[None] | None = None
    try:
        await job.start()
        await job.subscribed()
        training = job.training
        training.auto_restart = False
        if scenario.node_agent:
            agent = asyncio.create_task(_node_agent(job))
        if scenario.kill_ranks and scenario.kill_at == "start":
            training.disconnect_ranks(scenario.kill_ranks)
        if scenario.idle:
            await asyncio.sleep(scenario.idle)  # the idle time is the behaviour under test (pings)
        if scenario.fault_rank >= 0:
            training.inject_fault({scenario.fault_rank: FAULT_TYPES[scenario.fault_kind]})
        if scenario.kill_ranks and scenario.kill_at != "start":
            await journal.wait_for(MOMENTS[scenario.kill_at][1], SIM_BOUND)
            training.disconnect_ranks(scenario.kill_ranks)
        written: list[tr.Step] = []
        for write in scenario.platform_writes:
            await journal.wait_for(MOMENTS[write.at][1], SIM_BOUND)
            await asyncio.sleep(write.after * SIM_SCALE)  # the platform's delay is the behaviour under test
            sent = [e for e in journal.signals(job_id=spec.job_id) if e.name not in ("keep-alive", "rankTable")]
            job.sim.platform_annotate(spec.job_id, write.annotations)
            written.append(_platform_step(write, len(sent)))
        if scenario.clusterd_outage:
            await journal.wait_for(MOMENTS["stop-complete"][1], SIM_BOUND)
            address = job.sim.address
            await job.sim.stop()
            journal.record("state", "clusterd-restarted", "", listen=address)
            await asyncio.sleep(scenario.clusterd_outage)  # the outage is the behaviour under test
            await job.sim.start(address)
        if scenario.ends_at:
            await journal.wait_for(MOMENTS[scenario.ends_at][1], SIM_BOUND)
        else:
            cycles = scenario.cycles_on(release)
            await eventually(lambda: len(journal.action_paths()) >= cycles, SIM_BOUND,
                             f"the simulated ClusterD closing {cycles} cycle(s)")
        if scenario.entry_exits:
            exit_code = await job.wait_exit(SIM_BOUND)
        await asyncio.sleep(SIM_SETTLE)  # the quiet time is the behaviour under test
        if agent is not None and agent.done():
            agent.result()  # its failure, if it failed
        # The recorder is read by `tft-bridge history` processes: in a thread, so the
        # loop (the bridge's, the simulated ClusterD's keep-alives) never stalls on them.
        events = await asyncio.to_thread(_bridge_events, recorder)
        transcript = sim_transcript(journal, list(job.training.events), events, spec.job_id)
        transcript.steps = sorted([*transcript.steps, *written], key=lambda s: s.at)
        podgroup = job.sim.podgroup(spec.job_id)
        transcript.annotations = {key: podgroup.get(key) for key in scenario.compared_annotations}
    except Exception as error:  # the simulated run's own failure, with what it had seen
        events = await asyncio.to_thread(_bridge_events, recorder)
        seen = sim_transcript(journal, list(job.training.events), events, spec.job_id)
        raise AssertionError(f"the simulated run of {scenario.name} on {release} failed: {error}\n{seen}") from error
    finally:
        if agent is not None:
            agent.cancel()
            await asyncio.gather(agent, return_exceptions=True)
        stopped = await job.stop()
    transcript.exit_code = exit_code if scenario.entry_exits else stopped
    return transcript


def _bridge_events(directory: Path) -> list[dict[str, Any]]:
    """The bridge's flight recorder, read as ``tft-bridge history --json`` shows it (the
    same reader as the real run's, tests/conformance/peers.py)."""
    listing = _history(directory)
    events: list[dict[str, Any]] = []
    for cycle in sorted(listing.get("cycles", []), key=lambda c: c.get("started") or 0):
        for event in _history(directory, "--cycle", cycle["key"]).get("events", []):
            events.append({**event, "cycle": cycle.get("uuid") or cycle["key"]})
    return events


def sim_transcript(journal: Journal, records: Sequence[Record], bridge_events: Sequence[Mapping[str, Any]],
                   job_id: str) -> tr.Transcript:
    """A simulated run in the real runs' steps: ClusterD's from the simulated ClusterD's
    journal, the controller's from the stub's observation log, the bridge's from its
    flight recorder."""
    entries = [e for e in journal if e.job_id == job_id]
    steps = [*clusterd_steps_sim(entries), *controller_steps_sim(records)]
    steps += [tr.Step("clusterd", "cycle", "closed", detail=path, at=at) for path, at in journal.action_paths(job_id)]
    offset = time.time() - time.monotonic()
    steps += [replace(s, at=s.at - offset) if s.at else s for s in tr.bridge_steps(bridge_events)]
    steps.sort(key=lambda s: s.at)
    outcomes = [s.name for s in steps if s.side == "clusterd" and s.kind == "outcome"]
    return tr.Transcript(steps, outcomes[-1] if outcomes else None, None)


def _status_code(detail: Mapping[str, Any]) -> int | None:
    status = detail.get("status")
    return int(status["code"]) if isinstance(status, Mapping) and "code" in status else None


def clusterd_steps_sim(entries: Sequence[JournalEntry]) -> list[tr.Step]:
    """The simulated ClusterD's RPCs, signals and outcomes, as the real one's log shows them."""
    steps: list[tr.Step] = []
    for entry in entries:
        d, at = entry.detail, entry.at
        if entry.kind == "rpc" and entry.code is not None:
            if entry.name in ("Init", "Register"):
                steps.append(tr.Step("clusterd", "rpc", entry.name, at=at))
            elif entry.name == "ReportProcessFault":
                steps.append(tr.Step("clusterd", "rpc", entry.name, faults=tr.faults_text(d.get("faults") or {}), at=at))
            elif entry.name == "ReportStopComplete":
                steps.append(tr.Step("clusterd", "rpc", entry.name, code=_status_code(d), at=at))
            elif entry.name == "ReportRecoverStrategy":
                steps.append(tr.Step("clusterd", "rpc", entry.name, detail=" ".join(d.get("strategies") or ()), at=at))
            elif entry.name == "ReportRecoverStatus":
                steps.append(tr.Step("clusterd", "rpc", entry.name, code=_status_code(d),
                                     strategy=str(d.get("strategy") or ""), at=at))
        elif entry.kind == "stream-open" and entry.name == "SubscribeProcessManageSignal":
            steps.append(tr.Step("clusterd", "rpc", "Subscribe", at=at))
        elif entry.kind == "signal" and entry.name not in ("keep-alive", "rankTable"):
            steps.append(tr.Step("clusterd", "signal", entry.name, faults=tr.faults_text(d.get("faults") or {}),
                                 strategy=str(d.get("changeStrategy") or ""), detail=str(d.get("uuid") or ""), at=at))
        elif entry.kind == "annotation" and entry.name == "ProcessRecoverStatus":
            steps.append(tr.Step("clusterd", "outcome", str(d.get("value")), at=at))
        elif entry.kind == "platform":
            steps.append(tr.Step("clusterd", "platform", entry.name, faults=tr.faults_text(d.get("faults") or ""),
                                 strategy=str(d.get("strategy") or ""), code=entry.code, at=at))
    return steps


def controller_steps_sim(records: Sequence[Record]) -> list[tr.Step]:
    """The stub's callbacks and notifies, as the real controller's log shows them."""
    steps: list[tr.Step] = []
    for record in records:
        args, at = record.args, record.t
        if record.kind == "callback":
            name = record.name
            if name == "report_fault_ranks" and args:
                steps.append(tr.Step("controller", "callback", name, faults=tr.faults_text(args[0]), at=at))
            elif name == "report_stop_complete" and len(args) >= 3:
                steps.append(tr.Step("controller", "callback", name, faults=tr.faults_text(args[2]), code=args[0], at=at))
            elif name == "report_strategies" and len(args) >= 2:
                steps.append(tr.Step("controller", "callback", name, faults=tr.faults_text(args[0]),
                                     detail=" ".join(args[1]), at=at))
            elif name == "report_result" and len(args) >= 4:
                steps.append(tr.Step("controller", "callback", name, faults=tr.faults_text(args[2]), code=args[0],
                                     strategy=args[3], at=at))
            else:
                steps.append(tr.Step("controller", "callback", name, detail=repr(args), at=at))
        elif record.kind == "notify":
            if record.name in ("stop_train", "on_global_rank"):
                steps.append(tr.Step("controller", "notify", record.name, at=at))
            elif record.name == "change_strategy" and args:
                steps.append(tr.Step("controller", "notify", "change_strategy", strategy=str(args[0]), at=at))
            elif record.name == "prepare_action":
                steps.append(tr.Step("controller", "notify", "prepare_action", detail=repr(args), at=at))
    return steps


# --------------------------------------------------------------------------- the comparison
#: What is compared of each side: (kind, name, fault ranks, strategy, code, and the
#: strategy list of a strategies report/callback). Times, uuids and free text are not.
#: A notify's fault ranks are not: the real controller logs only the ranks new to it.
def _key(step: tr.Step) -> tuple[Any, ...]:
    faults = "" if step.kind == "notify" else step.faults
    return (step.kind, step.name, faults, step.strategy, step.code, _compared_detail(step))


def _compared_detail(step: tr.Step) -> str:
    """The strategies offered, a cycle's state path and the signals sent before a
    platform's write: the only free text compared."""
    if step.kind == "cycle" or step.side == "platform" or step.name in ("ReportRecoverStrategy", "report_strategies"):
        return step.detail
    return ""


def _shown(step: tr.Step | None) -> str:
    if step is None:
        return "(nothing)"
    detail = _compared_detail(step)
    return f"{step} [{detail}]" if detail else str(step)


COMPARED = {"clusterd": ("rpc", "signal", "outcome", "cycle", "platform"), "controller": ("callback", "notify"),
            "bridge": ("rpc", "signal", "notify", "outcome"), "platform": ("annotate",)}


def steps_of(transcript: tr.Transcript, name: str, kind: str) -> list[tr.Step]:
    """One side's steps of one kind, in order: each kind is compared as a sequence of
    its own. Their interleaving is not: a peer logs them from different threads (the
    real ClusterD logs a signal once it was sent, and may log the answer to it first;
    the controller logs notifies and callbacks on two threads). The bridge's calls that
    never reached a ClusterD (a gRPC status such as UNAVAILABLE, not ClusterD's code)
    are left out: how many reconnect attempts fall into an outage follows its timing,
    and what reached ClusterD is compared on ClusterD's side."""
    return [s for s in transcript.steps if s.side == name and s.kind == kind
            and not (name == "bridge" and kind == "rpc" and isinstance(s.code, str))]


#: The call ClusterD is killed on in a scenario with an outage (``clusterd_outage``).
OUTAGE_CALL = "ReportStopComplete"


def _outage_raced(steps: list[tr.Step]) -> list[tr.Step]:
    """The bridge's calls without the one ClusterD was killed on: ClusterD received it
    (its side shows it), but whether its answer beat the -9 follows the timing, so the
    bridge records code 0 or a gRPC status. Only before the bridge's reconnect (its
    first Init in the record): the same call after the restart is compared."""
    reconnect = next((i for i, s in enumerate(steps) if s.name == "Init"), 0)
    return [s for i, s in enumerate(steps) if not (i < reconnect and s.name == OUTAGE_CALL)]


def _compared_steps(transcript: tr.Transcript, name: str, kind: str, outage: bool) -> list[tr.Step]:
    steps = steps_of(transcript, name, kind)
    return _outage_raced(steps) if outage and (name, kind) == ("bridge", "rpc") else steps


def differences(real: tr.Transcript, sim: tr.Transcript, *, outage: bool = False) -> list[str]:
    """Where the simulated run differs from the real one: per side and kind, the first
    step that differs; the outcome; the exit code. Empty when they agree. ``outage``:
    the scenario kills ClusterD at a call (``_outage_raced``; ``Scenario.clusterd_outage``)."""
    found: list[str] = []
    for name, kinds in COMPARED.items():
        for kind in kinds:
            ours, theirs = _compared_steps(real, name, kind, outage), _compared_steps(sim, name, kind, outage)
            if [_key(s) for s in ours] == [_key(s) for s in theirs]:
                continue
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if _key(a) != _key(b)),
                      min(len(ours), len(theirs)))
            real_here = ours[at] if at < len(ours) else None
            sim_here = theirs[at] if at < len(theirs) else None
            found.append(f"{name} {kind} #{at + 1}: real {_shown(real_here)} | sim {_shown(sim_here)}")
    if real.outcome != sim.outcome:
        found.append(f"ProcessRecoverStatus: real {real.outcome} | sim {sim.outcome}")
    if real.exit_code != sim.exit_code:
        found.append(f"exit code: real {real.exit_code} | sim {sim.exit_code}")
    for key in sorted(set(real.annotations) | set(sim.annotations)):
        if real.annotations.get(key) != sim.annotations.get(key):
            found.append(f"PodGroup {key}: real {real.annotations.get(key)!r} | sim {sim.annotations.get(key)!r}")
    return found


def report(scenario: Scenario, release: str, real: tr.Transcript, sim: tr.Transcript, found: list[str]) -> str:
    """Both transcripts, compared steps only, side by side per side and kind (``!``
    where they differ): the failure's message."""
    outage = scenario.clusterd_outage > 0
    lines = [f"scenario {scenario.name} on {release}: the simulations differ from the real peers", *found]
    for name, kinds in COMPARED.items():
        for kind in kinds:
            ours, theirs = _compared_steps(real, name, kind, outage), _compared_steps(sim, name, kind, outage)
            lines.append(f"--- {name} {kind}: real | sim")
            for index in range(max(len(ours), len(theirs))):
                a = ours[index] if index < len(ours) else None
                b = theirs[index] if index < len(theirs) else None
                same = a is not None and b is not None and _key(a) == _key(b)
                lines.append(f"{' ' if same else '!'} {_shown(a) if a else '':<70} | {_shown(b) if b else ''}")
    lines.append(f"real: outcome={real.outcome} exit={real.exit_code} {real.annotations}; "
                 f"sim: outcome={sim.outcome} exit={sim.exit_code} {sim.annotations}")
    return "\n".join(lines)
