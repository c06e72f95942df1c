"""The platform agent's Prometheus metrics, on the bridge's conventions.

One ``CollectorRegistry`` per agent, every series named ``tft_bridge_platform_*``,
counters ending in ``_total``, durations in seconds, and labels from small fixed sets:
never a namespace, a PodGroup name or a rank (a cluster has thousands; the agent's log
names them). State owned elsewhere (PodGroups watched, watch up) is read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from bridge._version import __version__
from bridge.core.metrics_http import sample

#: ClusterD polls for the answer every 3 s and gives up after 300 s.
ANSWER_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60, 120, 300)
API_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

#: ``status`` label values of the cycle-end counter (anything else is "other").
STATUS_LABELS = ("retry-success", "retry-failed", "recover-success", "recover-failed",
                 "dump-success", "dump-failed", "exit-completed")


class PlatformMetrics:
    """All metrics of one platform agent, registered in ``self.registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.build_info = Info("tft_bridge_platform_build", "Version of the platform agent", registry=r)
        self.build_info.info({"version": __version__})
        self.confirms = Counter(
            "tft_bridge_platform_cycles",
            "Fault cycles seen: a new ProcessConfirmFault from ClusterD waiting for an answer", registry=r)
        self.answers = Counter(
            "tft_bridge_platform_answers",
            "Confirm steps answered (ProcessResultFault written), by the strategy written with it",
            ["strategy"], registry=r)
        self.answer_seconds = Histogram(
            "tft_bridge_platform_confirm_answer_seconds",
            "From seeing a ProcessConfirmFault to the answer being stored", buckets=ANSWER_BUCKETS, registry=r)
        self.strategies = Counter(
            "tft_bridge_platform_strategies_written",
            "ProcessRecoverStrategy values written, by value (\"none\" for the empty reset) and reason "
            "(standing, answer, reset)", ["strategy", "reason"], registry=r)
        self.cycle_ends = Counter(
            "tft_bridge_platform_recover_statuses",
            "ProcessRecoverStatus values ClusterD wrote, by value", ["status"], registry=r)
        self.clears = Counter(
            "tft_bridge_platform_clears",
            "Stale-key clears after a cycle step, by trigger (status, paused, stale_result, timeout)",
            ["reason"], registry=r)
        self.conflicts = Counter(
            "tft_bridge_platform_conflicts",
            "Conditional writes refused with 409 Conflict (re-read and re-decided)", registry=r)
        self.malformed = Counter(
            "tft_bridge_platform_malformed_annotations",
            "Malformed annotation values seen, by key and kind (dropped, rejected, poisoned: ClusterD's "
            "reading of a fault string; invalid: a value ClusterD does not accept)", ["key", "kind"], registry=r)
        self.watch_restarts = Counter(
            "tft_bridge_platform_watch_restarts",
            "PodGroup watch restarts, by reason (expired: 410, error: connection or API error, "
            "timeout: the server ended the watch)", ["reason"], registry=r)
        self.api_requests = Counter(
            "tft_bridge_platform_api_requests",
            "Kubernetes API requests, by operation and result", ["operation", "result"], registry=r)
        self.api_seconds = Histogram(
            "tft_bridge_platform_api_request_duration_seconds",
            "Kubernetes API request latency by operation", ["operation"], buckets=API_BUCKETS, registry=r)
        self.source_errors = Counter(
            "tft_bridge_platform_fault_source_errors",
            "Platform fault source calls that failed or timed out (the answer then used ClusterD's faults)",
            registry=r)
        self.policy_reloads = Counter(
            "tft_bridge_platform_policy_reloads", "Policy file reloads, by result", ["result"], registry=r)
        self.loop_errors = Counter(
            "tft_bridge_platform_internal_errors", "Unexpected errors caught in the agent's tasks", registry=r)
        self.podgroups = Gauge(
            "tft_bridge_platform_podgroups", "Platform-mode PodGroups watched", registry=r)
        self.watch_up = Gauge(
            "tft_bridge_platform_watch_up", "1 while the PodGroup watch is open", registry=r)
        self.podgroups.set_function(lambda: 0.0)

    def bind_podgroup_count(self, count: Callable[[], int]) -> None:
        self.podgroups.set_function(lambda: float(count()))

    def status_ended(self, status: str) -> None:
        self.cycle_ends.labels(status if status in STATUS_LABELS else "other").inc()

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        return sample(self.registry, name, labels)
