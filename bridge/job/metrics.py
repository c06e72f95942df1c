"""The per-job bridge's Prometheus metrics: one registry per bridge, every series ``tft_bridge_*``.

``BridgeMetrics`` creates and owns every metric. Counters end in ``_total``, durations
are seconds, labels stay low-cardinality (never a rank, a uuid or a job id); a label from
ClusterD's wire goes through ``signal_type_label`` or ``code_label`` (unknown values become
``other``). State owned elsewhere is read at scrape time through callbacks. Every series
whose label values are known in advance exists from the start with value 0. Updated on
the event loop and the report thread, read by the metrics endpoint (prometheus_client
locks each metric).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from bridge._version import __version__
from bridge.job.session.codes import Code
from bridge.faults import IMPLEMENTATION
from bridge.job.reports.controller_flow import Step
from bridge.job.reports.kinds import CALLBACKS, METHODS, REPORT_KINDS
from bridge.core.metrics_http import sample

#: Recovery takes seconds to many minutes (ClusterD alone waits ~11 s before globalFault).
RECOVERY_BUCKETS = (0.5, 1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600, 900, 1800)
#: Unary RPCs on loopback or a LAN: sub-millisecond to the deadline.
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

FAULT_TYPE_NAMES = {0: "uce", 1: "other", 2: "hccl"}

#: The label for a wire value outside the known set.
OTHER = "other"
#: ClusterD's signal types (docs/clusterd.md section 5); ``empty`` for a signal without one.
SIGNAL_TYPES = ("keep-alive", "stopTrain", "globalFault", "changeStrategy", "saveAndExit", "faultNodesExit",
                "preExitProcess", "killMaster", "hot-switch", "pauseStartAgent", "continueStartAgent")
_SIGNAL_TYPES = frozenset(SIGNAL_TYPES)
#: The Status codes of the protocol (bridge/job/session/codes.py), as label values.
_CODES = frozenset(int(code) for code in Code)
#: The unary RPCs the bridge makes, by the name the ``method`` label carries.
RPC_METHODS = ("Init", "Register", *(METHODS[kind].rsplit("/", 1)[-1] for kind in REPORT_KINDS))
#: The recovery phases (the report kinds, the ``kind`` label, are ``kinds.REPORT_KINDS``).
RECOVERY_PHASES = ("fault_to_stop", "stop_to_strategy", "strategy_to_result")
#: Why a signal or action was not forwarded (signals.py, clusterd.py, controller_flow.py's gate; a
#: test checks that every reason those modules use is listed here).
#: why the bridge reported a fault once more (bridge/job/reports/refault.py)
REREPORT_REASONS = ("record_held", "as_process_fault")
REFUSAL_REASONS = ("foreign_job", "duplicate", "malformed", "no_actions", "stale_cycle", "unexpected_step",
                   "clusterd_only_strategy", "unknown_strategy", "strategy_not_offered",
                   "unsupported_by_controller", "unknown_action", "too_many_actions", "bad_argument",
                   "orphaned_global_fault")
#: What the bridge did when a new ClusterD subscription came up during a controller's
#: fault flow (bridge/job/session/resume.py): re-reported the cycle's faults, rebound the flow to the
#: new cycle, answered a new signal with the controller's earlier report, or found the
#: controller already past the step the new ClusterD restarts at.
#: Why the flight recorder (bridge/job/recorder/) lost events or writes.
RECORDER_ERROR_REASONS = ("queue_full", "disk_full", "unwritable", "corrupt", "write_failed", "events_truncated",
                          "record_failed", "otel_export", "otel_queue_full")
#: ClusterD's operator (OM) flows the bridge answers (bridge/job/session/operator_actions.py), and what came of each.
OM_OPERATIONS = ("switch_nic", "stress_test")
OM_RESULTS = ("declined", "reply_failed", "foreign_job")
#: The auxiliary ClusterD streams (bridge/job/session/operator_actions.py, bridge/job/session/fault_centre.py), for their failures.
AUX_STREAMS = ("switch_nic", "stress_test", "fault_info")
#: What came of a FaultMsgSignal from ClusterD's Fault service (bridge/job/session/fault_centre.py).
FAULT_INFO_RESULTS = ("received", "foreign_job", "truncated", "unavailable")
#: What came of a fault handed to the bridge by ``tft-bridge report-fault`` (bridge/job/reports/operator_faults.py).
LOCAL_REPORT_RESULTS = ("accepted", "bad_input", "wrong_job", "refused")
RESUME_RESULTS = ("re_reported", "rebound", "answered_stop_complete", "answered_strategies",
                  "answered_without_repair", "too_late")
#: Final strategies every job with process-level recovery can end a cycle with (the elastic
#: ones appear when first used). Pre-created because a histogram child born at its first
#: observation makes that recovery invisible to rate() and histogram_quantile() -- and the
#: first recovery of a bridge's life is often its only one.
RECOVERY_OUTCOMES = (("retry", "success"), ("retry", "failed"), ("recover", "success"), ("recover", "failed"),
                     ("dump", "success"), ("dump", "failed"), ("exit", "exit"),
                     ("retry", "repeat_after_success"))


def signal_type_label(signal_type: str) -> str:
    """The ``signal_type`` label: a known ClusterD signal type, ``empty``, or ``other``."""
    if not signal_type:
        return "empty"
    return signal_type if signal_type in _SIGNAL_TYPES else OTHER


def code_label(code: int) -> str:
    """The ``code`` label of a ClusterD Status code: the decimal code when the protocol
    knows it (bridge/job/session/codes.py), else ``other`` (the int32 is the peer's to fill)."""
    return str(code) if code in _CODES else OTHER


def drop_reason_for_code(code: int) -> str:
    """The ``reason`` of a report ClusterD refused with ``code``: ``code_<n>`` or ``code_other``."""
    return f"code_{code_label(code)}"


class BridgeMetrics:
    """All metrics of one bridge, registered in ``self.registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.build_info = Info("tft_bridge_build", "Version and active fault-codec implementation", registry=r)
        self.build_info.info({"version": __version__, "codec": IMPLEMENTATION})

        self.faults_reported = Counter(
            "tft_bridge_faults_reported", "Fault ranks the controller reported, by fault type",
            ["fault_type"], registry=r)
        self.faulty_ranks = Gauge(
            "tft_bridge_faulty_ranks", "Ranks currently known faulty in the running recovery cycle", registry=r)
        self.recovery_cycles = Counter(
            "tft_bridge_recovery_cycles", "Recovery cycles that ended, by final strategy and outcome",
            ["strategy", "outcome"], registry=r)
        self.recovery_repeats = Counter(
            "tft_bridge_recovery_repeated_cycles",
            "Cycles ClusterD started again for ranks whose retry had just succeeded, with no new fault (ClusterD "
            "v7.3.2's fault centre); their result is counted with the outcome repeat_after_success", registry=r)
        self.fault_rereports = Counter(
            "tft_bridge_fault_rereports",
            "Fault reports ClusterD answered OK without starting a recovery while the controller waited, reported "
            "once more (reason: record_held = the same UCE/HCCL fault again once ClusterD's fault centre no longer "
            "held its record; as_process_fault = as a process fault, when the controller's wait ends before that)",
            ["reason"], registry=r)
        self.recovery_phase_seconds = Histogram(
            "tft_bridge_recovery_phase_duration_seconds",
            "Duration of each recovery phase (fault_to_stop, stop_to_strategy, strategy_to_result)",
            ["phase"], buckets=RECOVERY_BUCKETS, registry=r)
        self.recovery_seconds = Histogram(
            "tft_bridge_recovery_duration_seconds", "Fault report to final result, by strategy",
            ["strategy"], buckets=RECOVERY_BUCKETS, registry=r)
        self.rpcs = Counter(
            "tft_bridge_clusterd_rpcs", "ClusterD RPCs by method and result (Status code or gRPC status)",
            ["method", "code"], registry=r)
        self.rpc_seconds = Histogram(
            "tft_bridge_clusterd_rpc_duration_seconds", "ClusterD unary RPC latency by method",
            ["method"], buckets=RPC_BUCKETS, registry=r)
        self.reports_dropped = Counter(
            "tft_bridge_reports_dropped", "Reports not delivered to ClusterD, by kind and reason",
            ["kind", "reason"], registry=r)
        self.reports_merged = Counter(
            "tft_bridge_fault_reports_merged", "Fault reports merged into another request", registry=r)
        self.reports_sent = Counter(
            "tft_bridge_reports_sent", "Reports ClusterD accepted (code 0), by kind", ["kind"], registry=r)
        self.signals_received = Counter(
            "tft_bridge_signals_received", "Signals received from ClusterD, by signal type",
            ["signal_type"], registry=r)
        self.signals_refused = Counter(
            "tft_bridge_signals_refused", "Signals or actions not forwarded to the controller, by reason",
            ["reason"], registry=r)
        self.notifies = Counter(
            "tft_bridge_controller_notifies", "Notify calls into the controller, by action and result",
            ["action", "result"], registry=r)
        self.callbacks = Counter(
            "tft_bridge_controller_callbacks", "Callbacks from the controller, by callback",
            ["callback"], registry=r)
        self.callback_errors = Counter(
            "tft_bridge_controller_callback_errors",
            "Unexpected errors caught in a controller callback (never re-raised into the controller)", registry=r)
        self.subscription_up = Gauge(
            "tft_bridge_subscription_up", "1 while the ClusterD signal stream is live", registry=r)
        self.reconnects = Counter(
            "tft_bridge_subscription_reconnects", "Signal stream (re)subscriptions, by reason the previous ended",
            ["reason"], registry=r)
        self.clusterd_connection_lost = Counter(
            "tft_bridge_clusterd_connection_lost",
            "Connections to ClusterD closed under the bridge, by channel (signal, report): a GOAWAY such as "
            "too_many_pings, or a lost connection; gRPC reconnects at the next call", ["channel"], registry=r)
        self.process_recover_enabled = Gauge(
            "tft_bridge_process_recover_enabled",
            "1 recovery on, 0 ClusterD answered Init with 403 (process-level recovery off), -1 no Init answer yet",
            registry=r)
        self.process_recover_enabled.set(-1)
        self.keepalive_age = Gauge(
            "tft_bridge_keepalive_age_seconds", "Seconds since the last message on the signal stream", registry=r)
        self.controller_connected = Gauge(
            "tft_bridge_controller_ranks_connected",
            "1 while at least one training rank is connected to the controller (the HA switch)", registry=r)
        self.realtime_thread = Gauge(
            "tft_bridge_realtime_thread",
            "1 while this thread (loop, report) runs under SCHED_FIFO (controller.realtime_priority); 0: it waits for "
            "a core when the node is busy (refused; report: whether the report wire may, probed at its start); not "
            "exported with realtime_priority 0", ["thread"], registry=r)
        self.controller_cpu = Gauge(
            "tft_bridge_controller_cpu",
            "The CPU the controller's callback thread and the report wire's thread are pinned to (controller.pin_cpu); "
            "-1: not pinned (off, refused, or no callback yet)", registry=r)
        self.controller_cpu.set(-1)
        self.outbox_depth = Gauge(
            "tft_bridge_outbox_depth", "Reports waiting to be delivered to ClusterD", registry=r)
        self.bad_inputs = Counter(
            "tft_bridge_bad_inputs", "Malformed inputs rejected, by kind", ["kind"], registry=r)
        self.hook_runs = Counter(
            "tft_bridge_hook_runs", "Operator hook commands run, by hook and result", ["hook", "result"], registry=r)
        self.ranktable_updates = Counter(
            "tft_bridge_ranktable_updates", "Rank tables received, by result (written, unchanged, rejected)",
            ["result"], registry=r)
        self.recorder_errors = Counter(
            "tft_bridge_recorder_errors",
            "Flight-recorder events or writes lost, by reason (RECORDER_ERROR_REASONS); the bridge itself carries on",
            ["reason"], registry=r)
        self.flow_desync = Counter(
            "tft_bridge_flow_desync",
            "Controller callbacks the tracked flow step did not expect (the tracker then follows the controller), "
            "by callback and the step it arrived at", ["callback", "step"], registry=r)
        self.cycle_resumes = Counter(
            "tft_bridge_cycle_resumes",
            "Recoveries carried across a ClusterD restart or freeze (a new subscription mid-flow), by result",
            ["result"], registry=r)
        self.om_requests = Counter(
            "tft_bridge_om_requests",
            "ClusterD operator requests for the job's ranks (NIC switch, stress test) by operation and result: "
            "declined (answered at once that the bridge does not perform it, so ClusterD resumes or recovers the "
            "job), reply_failed (the answer did not reach ClusterD), foreign_job", ["operation", "result"],
            registry=r)
        self.aux_stream_failures = Counter(
            "tft_bridge_clusterd_stream_failures",
            "Failed subscriptions or broken streams of the auxiliary ClusterD streams (switch_nic, stress_test, "
            "fault_info), each followed by a re-subscription after a jittered back-off", ["stream"], registry=r)
        self.fault_info = Counter(
            "tft_bridge_fault_info_messages",
            "Messages of ClusterD's Fault service for the job, by result (received, foreign_job, truncated: cut to "
            "the recorder's bound, unavailable: the release does not serve it)", ["result"], registry=r)
        self.local_reports = Counter(
            "tft_bridge_local_fault_reports",
            "Faults handed to the bridge by tft-bridge report-fault, by result", ["result"], registry=r)
        self.keepalive_age.set_function(lambda: 0.0)
        self.controller_connected.set_function(lambda: 0.0)
        self._precreate()

    def _precreate(self) -> None:
        """Create every child whose labels are known, at 0 (see the module docstring)."""
        for name in FAULT_TYPE_NAMES.values():
            self.faults_reported.labels(name)
        for channel in ("signal", "report"):
            self.clusterd_connection_lost.labels(channel)
        for signal_type in (*SIGNAL_TYPES, OTHER):
            self.signals_received.labels(signal_type)
        for reason in REREPORT_REASONS:
            self.fault_rereports.labels(reason)
        for reason in REFUSAL_REASONS:
            self.signals_refused.labels(reason)
        for method in RPC_METHODS:
            self.rpcs.labels(method, str(int(Code.OK)))
            self.rpc_seconds.labels(method)
        for kind in REPORT_KINDS:
            self.reports_sent.labels(kind)
        for phase in RECOVERY_PHASES:
            self.recovery_phase_seconds.labels(phase)
        for strategy, outcome in RECOVERY_OUTCOMES:
            self.recovery_cycles.labels(strategy, outcome)
            self.recovery_seconds.labels(strategy)
        for callback in CALLBACKS:
            self.callbacks.labels(callback)
            for step in Step:
                self.flow_desync.labels(callback, step.value)
        for result in RESUME_RESULTS:
            self.cycle_resumes.labels(result)
        for reason in RECORDER_ERROR_REASONS:
            self.recorder_errors.labels(reason)
        for result in ("written", "unchanged", "rejected", "write_failed"):
            self.ranktable_updates.labels(result)
        for operation in OM_OPERATIONS:
            for result in OM_RESULTS:
                self.om_requests.labels(operation, result)
        for stream in AUX_STREAMS:
            self.aux_stream_failures.labels(stream)
        for result in FAULT_INFO_RESULTS:
            self.fault_info.labels(result)
        for result in LOCAL_REPORT_RESULTS:
            self.local_reports.labels(result)

    def count_desync(self, callback: str, step: Step) -> None:
        """The ``on_desync`` hook of ``ControllerFlow``: one unexpected callback."""
        self.flow_desync.labels(callback, step.value).inc()

    def bind_keepalive_clock(self, last_message_at: Callable[[], float | None]) -> None:
        """Read the keep-alive age from the session at scrape time (-1 before any message)."""

        def age() -> float:
            last = last_message_at()
            return -1.0 if last is None else max(0.0, time.monotonic() - last)

        self.keepalive_age.set_function(age)

    def bind_realtime_threads(self, queries: Mapping[str, Callable[[], bool]]) -> None:
        """Whether each report-path thread is realtime (bridge/job/sched/realtime.py), read at scrape time."""
        for thread, query in queries.items():
            self.realtime_thread.labels(thread).set_function(lambda query=query: 1.0 if query() else 0.0)

    def bind_controller_cpu(self, query: Callable[[], int]) -> None:
        """Where the controller's thread and the report wire's thread are pinned (bridge/job/sched/affinity.py)."""
        self.controller_cpu.set_function(lambda: float(query()))

    def bind_controller_switch(self, query: Callable[[], bool]) -> None:
        def connected() -> float:
            try:
                return 1.0 if query() else 0.0
            except Exception:  # a scrape must not fail because the controller is gone
                return 0.0

        self.controller_connected.set_function(connected)

    def count_faults(self, faults: dict[int, int]) -> dict[str, int]:
        """Count a report's fault ranks by type; the counts, by type name (the flight
        recorder keeps them: counting a 100 000-rank map twice would cost the loop)."""
        counts = {FAULT_TYPE_NAMES[fault_type]: count
                  for fault_type, count in collections.Counter(faults.values()).items()}  # counted in C
        for name, count in counts.items():
            self.faults_reported.labels(name).inc(count)
        return counts

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        return sample(self.registry, name, labels)
