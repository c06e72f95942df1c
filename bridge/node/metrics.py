"""The node's one metrics endpoint: the service's own ``tft_bridge_node_*`` series, and
every job's bridge series with a ``tft_job`` label (the job id), read from the bridges'
loopback endpoints at each scrape (one scrape target per node, as node exporters are).
Not ``job``: that is Prometheus's own scrape-job label, which a relayed ``job`` would
either be renamed away from (``exported_job``) or overwrite (``honor_labels``).

Each bridge keeps its own registry and endpoint on 127.0.0.1 (the bridge process owns
its numbers; the node service only relays them). A scrape of the node reads them all
concurrently, each bounded by ``metrics.scrape_timeout``, and the whole scrape by that
plus a second: a stuck bridge costs its own series (``tft_bridge_node_job_scrape_up{tft_job}
= 0``), never the node's answer. ``tft_bridge_node_job_bridge_running{tft_job}`` is there
for every job whose controller pod the service serves on this node, 0 while that job has
no running bridge (a restart pending, stopped by an operator, given up): a bridge that
ended cannot say so itself, its series just leave the endpoint.
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait

from prometheus_client import CollectorRegistry, Counter, Gauge, Info
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from bridge._version import __version__
from bridge.node.podspec import IGNORED_REASONS, REASONS

log = logging.getLogger("tft_bridge.node.metrics")

#: Why the node service started a bridge (label of tft_bridge_node_bridge_starts_total).
START_CAUSES = ("job", "incarnation", "rescheduled", "controller_ended", "failure")
#: The positive evidence a bridge was stopped on (service.py ``_evidence_gone``).
STOP_EVIDENCE = ("deleted", "terminal", "replaced")
#: What became of an Event the service posted (service.py ``EventPoster``).
EVENT_RESULTS = ("ok", "failed", "dropped")
#: The label relayed bridge series carry: the job id (the pod's MINDX_TASK_ID).
JOB_LABEL = "tft_job"


class NodeMetrics:
    """The service's own series (registered in ``registry``), and the bridges' relayed."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        Info("tft_bridge_node_build", "Version of the node service", registry=r).info({"version": __version__})
        self.watch_up = Gauge("tft_bridge_node_watch_up", "1 while the pod watch is open", registry=r)
        self.watch_restarts = Counter(
            "tft_bridge_node_watch_restarts", "Pod watch restarts, by reason (expired: 410, error, timeout)",
            ["reason"], registry=r)
        self.api_requests = Counter(
            "tft_bridge_node_api_requests", "Kubernetes API requests that failed or were made, by operation and "
            "result", ["operation", "result"], registry=r)
        self.loop_errors = Counter(
            "tft_bridge_node_internal_errors", "Unexpected errors caught in the node service's loops", registry=r)
        self.refusals = Counter(
            "tft_bridge_node_refusals", "Opted-in jobs refused a bridge, by reason (counted once per pod and "
            "reason)", ["reason"], registry=r)
        self.refused_now = Gauge(
            "tft_bridge_node_refused_jobs", "Opted-in controller pods on this node refused a bridge now, by reason",
            ["reason"], registry=r)
        for reason in REASONS:
            self.refusals.labels(reason)
            self.refused_now.labels(reason).set(0)
        self.ignored_now = Gauge(
            "tft_bridge_node_ignored_pods", "Opted-in pods on this node that get neither a bridge nor a refusal now, "
            "by reason (a worker pod, no RANK, host IP not written yet, terminal, being deleted)", ["reason"],
            registry=r)
        for reason in IGNORED_REASONS:
            self.ignored_now.labels(reason).set(0)
        self.bridges = Gauge("tft_bridge_node_bridges", "Bridges running on this node", registry=r)
        self.starts = Counter("tft_bridge_node_bridge_starts", "Bridges started, by cause", ["cause"], registry=r)
        self.exits = Counter("tft_bridge_node_bridge_exits", "Bridges that ended, by exit code", ["code"],
                             registry=r)
        self.stops = Counter("tft_bridge_node_bridge_stops", "Bridges stopped by the node service, by the "
                             "evidence that their job was gone", ["evidence"], registry=r)
        self.adopted = Counter("tft_bridge_node_bridges_adopted", "Running bridges adopted at a start of the "
                               "node service", registry=r)
        self.events = Counter("tft_bridge_node_events", "Kubernetes Events posted on pods, by result", ["result"],
                              registry=r)
        for cause in START_CAUSES:
            self.starts.labels(cause)
        for evidence in STOP_EVIDENCE:
            self.stops.labels(evidence)
        for result in EVENT_RESULTS:
            self.events.labels(result)
        self.watch_up.set(0)

    def set_refused(self, counts: dict[str, int]) -> None:
        for reason in REASONS:
            self.refused_now.labels(reason).set(counts.get(reason, 0))

    def set_ignored(self, counts: dict[str, int]) -> None:
        for reason in IGNORED_REASONS:
            self.ignored_now.labels(reason).set(counts.get(reason, 0))


Target = tuple[str, int]  # (job id, the bridge's loopback metrics port)


class BridgeSeries:
    """A collector relaying every bridge's series with a ``tft_job`` label, and whether
    each served job has its bridge. ``targets`` and ``served`` are called on the scrape's
    thread: they must return values the service replaces whole, never mutates."""

    def __init__(self, targets: Callable[[], list[Target]], timeout: float = 2.0,
                 served: Callable[[], Mapping[str, bool]] | None = None) -> None:
        self._targets = targets
        self._served = served
        self._timeout = timeout
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="node-scrape")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def describe(self) -> Iterable[Metric]:
        return []  # dynamic: nothing to check at registration

    def collect(self) -> Iterable[Metric]:
        targets = self._targets()
        futures = {self._pool.submit(self._scrape, port): job for job, port in targets}
        done, _ = wait(futures, timeout=self._timeout + 1.0)
        up = GaugeMetricFamily("tft_bridge_node_job_scrape_up",
                               "1 when the job's bridge answered this scrape in time", labels=[JOB_LABEL])
        merged: dict[str, Metric] = {}
        for future, job in futures.items():
            families = future.result() if future in done else None
            up.add_metric([job], 1.0 if families is not None else 0.0)
            for family in families or []:
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(family.name, family.documentation, family.type,
                                                          family.unit)
                elif target.type != family.type:
                    continue
                for sample in family.samples:
                    target.samples.append(sample._replace(labels={**sample.labels, JOB_LABEL: job}))
        if self._served is not None:
            running = GaugeMetricFamily("tft_bridge_node_job_bridge_running",
                                        "1 when the job whose controller pod is served on this node has a running "
                                        "bridge, 0 while it has none", labels=[JOB_LABEL])
            for job, runs in sorted(self._served().items()):
                running.add_metric([job], 1.0 if runs else 0.0)
            yield running
        yield up
        yield from merged.values()

    def _scrape(self, port: int) -> list[Metric] | None:
        return fetch(port, self._timeout)


def fetch(port: int, timeout: float) -> list[Metric] | None:
    """The families a bridge's loopback endpoint serves, or None (starting, stopping, stuck)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
            text = response.read(16 * 1024 * 1024).decode("utf-8", "replace")
        return list(text_string_to_metric_families(text))
    except Exception as error:
        log.debug("reading the bridge's metrics on port %d failed: %s", port, error)
        return None


def read_sample(port: int, name: str, timeout: float) -> float | None:
    """One sample's value from a bridge's endpoint (None when it did not answer or lacks it)."""
    for family in fetch(port, timeout) or []:
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return None
