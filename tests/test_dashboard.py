"""The Grafana dashboard may query only metrics the bridge exports, and with their real labels.

The exported names come from a live ``BridgeMetrics`` registry. Every labelled metric is
touched once, so its samples exist under the names prometheus_client gives them
(``_total`` for counters, ``_bucket``/``_sum``/``_count`` for histograms, ``_info`` for
Info, gauges unchanged). Renaming or removing a metric therefore breaks this test until
the dashboard follows.

The last test runs the dashboard against a real Prometheus scraping the demo scenarios
(skipped without Debian's ``prometheus`` binary, required in CI). The name and label
checks above still earn their place: they run without Prometheus, and they catch what
Prometheus cannot -- a misspelt metric or label in a query is not an error in PromQL, only
an empty panel, and a panel over a counter the demo never moves is empty either way.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from bridge.job.metrics import BridgeMetrics
from bridge.job.session.orphan import orphan_gauge
from bridge.sim.scenario import free_port

from .conftest import eventually_sync
from .gated_demo import GATE_PROMPT
from .prometheus_bin import required_binary

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "contrib" / "grafana" / "tft-bridge.json"

METRIC = re.compile(r"\btft_bridge_[A-Za-z0-9_:]*")
# A metric name, then optionally its {matchers}.
SELECTOR = re.compile(r"\b(tft_bridge_[A-Za-z0-9_:]*)\s*(\{[^}]*\})?")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*\"((?:[^\"\\]|\\.)*)\"")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
RATE_ARG = re.compile(r"\b(?:rate|irate|increase|delta|idelta|deriv)\s*\(\s*(tft_bridge_[A-Za-z0-9_:]*)")
# Labels Prometheus adds to every series at scrape time.
TARGET_LABELS = {"job", "instance"}
DATASOURCE_REFS = {"${datasource}", "$datasource"}


# --------------------------------------------------------------------------- what the bridge exports

def bridge_metrics() -> BridgeMetrics:
    """A registry with every metric a running bridge registers: BridgeMetrics' own, and the
    orphaned-job gauge the bridge adds at start (bridge/job/session/orphan.py)."""
    metrics = BridgeMetrics()
    orphan_gauge(metrics)
    return metrics


def exported_samples() -> dict[str, set[str]]:
    """Every sample name a bridge exposes, mapped to its label names."""
    return touched_samples(bridge_metrics())


def node_samples() -> dict[str, set[str]]:
    """Every sample name the node endpoint of ``tft-bridge node`` exposes beside the bridges'
    (which it relays with a ``tft_job`` label): the service's own, and the per-job series
    it makes at each scrape (one job whose bridge does not answer: port 1 refuses)."""
    from bridge.node.metrics import BridgeSeries, NodeMetrics

    metrics = NodeMetrics()
    series = BridgeSeries(lambda: [("uid-x", 1)], timeout=1.0, served=lambda: {"uid-x": True})
    metrics.registry.register(series)  # type: ignore[arg-type]
    try:
        return touched_samples(metrics)
    finally:
        series.close()


def touched_samples(metrics: Any) -> dict[str, set[str]]:
    """``metrics``' registry's sample names and labels, every labelled metric touched once."""
    for metric in vars(metrics).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        names = metric._labelnames  # noqa: SLF001 - no public accessor; the tests' own registry
        child = metric.labels(*(f"test_{name}" for name in names)) if names else metric
        if isinstance(metric, Counter):
            child.inc()
        elif isinstance(metric, Histogram):
            child.observe(1.0)
        elif isinstance(metric, Gauge) and names:
            child.set(1.0)
    samples: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
    return samples


def exported_families() -> set[str]:
    return {family.name for family in bridge_metrics().registry.collect()}


def node_families() -> set[str]:
    return {name.removesuffix("_total").removesuffix("_info") for name in node_samples()
            if not name.endswith("_created")}  # prometheus_client's creation time of a counter


@pytest.fixture(scope="module")
def samples() -> dict[str, set[str]]:
    found = exported_samples()
    # The touching worked: one name of every kind is present, with its labels.
    assert "tft_bridge_clusterd_rpcs_total" in found and found["tft_bridge_clusterd_rpcs_total"] == {"method", "code"}
    assert "tft_bridge_recovery_duration_seconds_bucket" in found
    assert "tft_bridge_build_info" in found and {"version", "codec"} <= found["tft_bridge_build_info"]
    assert "tft_bridge_subscription_up" in found
    # node mode: the node endpoint relays them with tft_job, beside its own series
    relayed = {name: labels | {"tft_job"} for name, labels in found.items()}
    relayed.update(node_samples())
    assert relayed["tft_bridge_node_job_bridge_running"] == {"tft_job"}
    return relayed


# --------------------------------------------------------------------------- what the dashboard uses

@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def data_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in all_panels(dashboard) if p.get("type") != "row"]


def exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for panel in data_panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel.get('title')!r} target {target.get('refId')}", target.get("expr", "")
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable.get("query")
            text = query.get("query", "") if isinstance(query, dict) else query or ""
            yield f"variable ${variable['name']}", text


def unknown_metrics(dashboard: dict[str, Any], samples: dict[str, set[str]]) -> list[str]:
    return [f"{where}: {name} is not exported"
            for where, expr in exprs(dashboard) for name in METRIC.findall(expr) if name not in samples]


def label_problems(dashboard: dict[str, Any], samples: dict[str, set[str]]) -> list[str]:
    problems = []
    for where, expr in exprs(dashboard):
        used = set(METRIC.findall(expr))
        for name, matchers in SELECTOR.findall(expr):
            labels = samples.get(name, set()) | TARGET_LABELS
            for label, _, _ in MATCHER.findall(matchers or ""):
                if label not in labels:
                    problems.append(f"{where}: {name} has no label {label!r}")
        known = set().union(*(samples.get(name, set()) for name in used)) | TARGET_LABELS
        for group in GROUPING.findall(expr):
            for label in filter(None, (part.strip() for part in group.split(","))):
                if label not in known:
                    problems.append(f"{where}: grouping by {label!r}, which none of {sorted(used)} has")
    return problems


# --------------------------------------------------------------------------- tests

def test_dashboard_is_importable_json(dashboard: dict[str, Any]) -> None:
    assert dashboard["title"] and dashboard["uid"]
    assert dashboard.get("id") is None, "an exported id makes the import clash with the source instance"
    assert 36 <= dashboard["schemaVersion"] <= 41
    ids = [p["id"] for p in all_panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in all_panels(dashboard):
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel.get("title")


def test_template_variables(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    assert {"job", "instance", "tft_job"} <= set(variables)
    assert variables["tft_job"]["allValue"] == ".*"  # matches a per-job unit's series, which have no tft_job
    for name in ("job", "instance", "tft_job"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"]["uid"] in DATASOURCE_REFS


def test_every_panel_has_a_title_and_targets(dashboard: dict[str, Any]) -> None:
    panels = data_panels(dashboard)
    assert len(panels) >= 20
    for panel in panels:
        assert panel.get("title", "").strip(), f"panel {panel.get('id')} has no title"
        targets = panel.get("targets") or []
        assert targets, f"panel {panel['title']!r} has no target"
        for target in targets:
            assert METRIC.search(target.get("expr", "")), f"panel {panel['title']!r}: target without a bridge metric"
            assert target.get("refId")


def test_no_hard_coded_datasource(dashboard: dict[str, Any]) -> None:
    assert "__inputs" not in dashboard, "use the ${datasource} variable, not import-time inputs"
    problems = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "datasource":
                    uid = value.get("uid") if isinstance(value, dict) else value
                    if uid is not None and uid not in DATASOURCE_REFS:
                        problems.append(f"{path}.datasource = {value!r}")
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{path}[{index}]")

    walk(dashboard, "$")
    assert not problems, "hard-coded datasource:\n" + "\n".join(problems)
    for panel in data_panels(dashboard):
        assert panel.get("datasource", {}).get("uid") in DATASOURCE_REFS, panel["title"]


def test_every_queried_metric_is_exported(dashboard: dict[str, Any], samples: dict[str, set[str]]) -> None:
    problems = unknown_metrics(dashboard, samples)
    assert not problems, "\n".join(problems)


def test_a_made_up_metric_is_caught(dashboard: dict[str, Any], samples: dict[str, set[str]]) -> None:
    """The check above can fail: a wrong suffix and a made-up name are both reported."""
    broken = copy.deepcopy(dashboard)
    panel = data_panels(broken)[0]
    panel["targets"][0]["expr"] = "tft_bridge_subscription_up_total + tft_bridge_no_such_metric"
    problems = unknown_metrics(broken, samples)
    assert len(problems) == 2 and all(panel["title"] in p for p in problems)


def test_labels_exist(dashboard: dict[str, Any], samples: dict[str, set[str]]) -> None:
    problems = label_problems(dashboard, samples)
    assert not problems, "\n".join(problems)
    broken = copy.deepcopy(dashboard)
    data_panels(broken)[0]["targets"][0]["expr"] = 'sum by (rank) (tft_bridge_faulty_ranks{job="x", rank="3"})'
    assert len(label_problems(broken, samples)) == 2


def test_every_selector_follows_the_variables(dashboard: dict[str, Any]) -> None:
    for where, expr in exprs(dashboard):
        if where.startswith("variable"):
            continue
        for name, matchers in SELECTOR.findall(expr):
            assert 'instance=~"$instance"' in matchers and 'job=~"$job"' in matchers, f"{where}: {name}{matchers}"
            # a bridge's series (also relayed by a node endpoint) follow the job id too
            if not name.startswith("tft_bridge_node_") or name.startswith("tft_bridge_node_job_"):
                assert 'tft_job=~"$tft_job"' in matchers, f"{where}: {name}{matchers}"
        for group in GROUPING.findall(expr):
            labels = {part.strip() for part in group.split(",")}
            assert "instance" not in labels or "tft_job" in labels or all(
                name.startswith("tft_bridge_node_") for name in METRIC.findall(expr)), \
                f"{where}: by ({group}) merges the bridges of a node endpoint"


def test_functions_fit_the_metric_types(dashboard: dict[str, Any]) -> None:
    for where, expr in exprs(dashboard):
        for name in RATE_ARG.findall(expr):
            assert name.endswith(("_total", "_bucket", "_sum", "_count")), f"{where}: rate/increase of gauge {name}"
        if "histogram_quantile" in expr:
            assert "_bucket" in expr, f"{where}: histogram_quantile needs the _bucket series"
            groups = GROUPING.findall(expr)
            assert groups and all("le" in {p.strip() for p in g.split(",")} for g in groups), \
                f"{where}: histogram_quantile must aggregate by le"


def test_every_metric_family_has_a_panel(dashboard: dict[str, Any]) -> None:
    """A new metric should get a panel. Remove a family from the dashboard only on purpose."""
    used = {name for _, expr in exprs(dashboard) for name in METRIC.findall(expr)}
    missing = sorted(family for family in exported_families() | node_families()
                     if not any(name == family or name.startswith(family + "_") for name in used))
    assert not missing, f"metrics without a panel: {missing}"


# --------------------------------------------------------------------------- against a real Prometheus
#
# The label check above knows the names; only a real Prometheus knows whether an expression
# parses, whether a function fits the type it gets and whether a panel shows anything. A
# Prometheus (Debian's package, 1 s scrape interval, its own storage in tmp_path, loopback
# only) scrapes one `tft-bridge demo` per scenario, then every dashboard expression is
# evaluated through the HTTP API the way Grafana would ask: variables substituted, instant
# targets with /api/v1/query at the end of the range, range targets with
# /api/v1/query_range over it. The rule file is loaded as well, so the recording rules and
# alerts are evaluated on the same real data.

DEMO_SCENARIOS = ("retry", "recover", "retry-fails", "dump", "exit")
SCRAPE_INTERVAL = 1.0  # seconds: Prometheus' and the Grafana datasource's "scrape interval"
GRAFANA_MAX_DATA_POINTS = 1000  # about a full-width panel
RULES_FILE = DASHBOARD.parent.parent / "prometheus" / "tft-bridge.rules.yml"
HTTP_TIMEOUT = 5.0
# Range targets over counters must show the demo's events (a rate or increase that is not
# 0 somewhere). These may stay empty after the five demo scenarios, and why. Each is
# (panel title, refId).
#: Counters the demo never moves; the test checks that they really stayed at 0.
NEVER_MOVED: dict[tuple[str, str], str] = {
    ("Bad inputs by kind", "A"): "the demo feeds no malformed input",
    ("Controller callbacks", "B"): "no callback error in a clean demo",
    ("Controller flow desyncs by callback and step", "A"): "the controller never surprises the flow tracker",
    ("Rank table updates by result", "A"): "the demo subscribes to no rank table",
    ("Reports dropped by kind and reason", "A"): "no report is dropped in a clean recovery",
    ("Reports sent by kind", "B"): "one fault per scenario: nothing to merge",
    ("Flight recorder errors by reason", "A"): "nothing makes the recorder fail in the demo",
    ("Recoveries carried across a ClusterD restart, by result", "A"): "ClusterD never restarts in the demo",
    ("ClusterD connections lost by channel", "A"): "the demo's ClusterD closes no connection: every channel "
                                                   "pings as every release accepts",
    ("Retry cycles ClusterD repeated after a success", "A"): "the demo plays ClusterD master, which does not "
                                                             "repeat a retry that succeeded",
    ("ClusterD operator requests by operation and result", "A"): "no operator runs a NIC switch or a stress test",
    ("Auxiliary ClusterD stream failures by stream", "A"): "the demo's ClusterD serves every auxiliary stream "
                                                          "and breaks none",
    ("ClusterD fault messages by result", "A"): "the demo's faults are the controller's, not an NPU fault in "
                                                "ClusterD's fault centre",
    ("Faults handed over by tft-bridge report-fault, by result", "A"): "nobody runs tft-bridge report-fault",
    ("Faults reported again after ClusterD skipped them, by reason", "A"): "each demo has one fault, and ClusterD "
                                                                           "starts a cycle for it",
}
#: Counters with open-ended label values (not pre-created in bridge/job/metrics.py): the series
#: is born at its first event already at 1, so increase() shows 0 for that event. The
#: test checks that the series exist (the panel draws them at 0).
BORN_AT_FIRST_EVENT: dict[tuple[str, str], str] = {
    ("Hook runs by hook and result", "A"): "each demo runs one node action (no_hook), its first",
    ("Subscription reconnects by reason", "A"): "the one cycle_end reconnect of each demo is its first",
    ("Signals refused by reason", "A"): "dump: ClusterD repeats its exit notice once, refused as the first duplicate",
}


NODE_ROW = "Node service (node mode: tft-bridge node)"


def node_row_targets(dashboard: dict[str, Any]) -> set[tuple[str, str]]:
    """The node service's panels: the demo runs no node service, so they may be empty here
    (Prometheus must still accept their expressions); test_node_row_against_a_real_prometheus
    gives them data."""
    found: set[tuple[str, str]] = set()
    in_row = False
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            in_row = panel.get("title") == NODE_ROW
        elif in_row:
            found |= {(panel["title"], target["refId"]) for target in panel.get("targets", [])}
    assert found, f"no row {NODE_ROW!r}"
    return found


@dataclass
class DemoBridge:
    scenario: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def at_gate(self) -> bool:
        self._alive()
        return GATE_PROMPT in self.output()

    def release(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b"go\n")
        self.process.stdin.flush()

    def _alive(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(f"demo {self.scenario} exited with {self.process.returncode}:\n{self.output()}")

    def held(self) -> bool:
        """True once the scenario ended and the demo holds its metrics endpoint up."""
        self._alive()
        return "holding for" in self.output()

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


class PrometheusServer:
    """A throw-away Prometheus on loopback."""

    def __init__(self, workdir: Path, targets: dict[str, int], job_name: str = "tft-bridge-demo") -> None:
        binary = required_binary("prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        static = "\n".join(f"      - targets: ['127.0.0.1:{port}']\n        labels: {{scenario: '{name}'}}"
                           for name, port in targets.items())
        config.write_text(
            f"global:\n  scrape_interval: {SCRAPE_INTERVAL:g}s\n  scrape_timeout: {SCRAPE_INTERVAL:g}s\n"
            f"  evaluation_interval: {SCRAPE_INTERVAL:g}s\n"
            f"rule_files: ['{RULES_FILE}']\n"
            f"scrape_configs:\n  - job_name: {job_name}\n    static_configs:\n{static}\n",
            encoding="utf-8")
        self.log = workdir / "prometheus.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)

    def get(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=HTTP_TIMEOUT) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as error:  # 400/422: Prometheus says what is wrong in the body
            body = json.loads(error.read() or b"{}")
        return body

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.process.returncode}:\n{self.log.read_text()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=HTTP_TIMEOUT) as response:
                return response.status == 200
        except OSError:
            return False

    def scalar(self, expr: str) -> float | None:
        body = self.get("/api/v1/query", query=expr)
        result = body.get("data", {}).get("result") or []
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


def grafana_variables(start: float, end: float) -> dict[str, str]:
    """The built-in variables as Grafana computes them for a panel over [start, end]:
    ``$__interval`` is the range over the panel's data points, never below the datasource's
    scrape interval; ``$__rate_interval`` is max($__interval + scrape interval, 4 x scrape
    interval); ``$__range`` is the range in whole seconds."""
    span = end - start
    interval = max(SCRAPE_INTERVAL, math.ceil(span / GRAFANA_MAX_DATA_POINTS))
    rate_interval = max(interval + SCRAPE_INTERVAL, 4 * SCRAPE_INTERVAL)
    return {"$__rate_interval": f"{rate_interval:g}s", "$__interval": f"{interval:g}s",
            "$__range": f"{math.ceil(span)}s", "$job": ".*", "$instance": ".*",
            "$tft_job": ".*"}  # "All": allValue ".*"


def substitute(expr: str, variables: dict[str, str]) -> str:
    for name in sorted(variables, key=len, reverse=True):  # $__rate_interval before $__range
        expr = expr.replace(name, variables[name])
    assert "$" not in expr, f"unsubstituted variable in {expr!r}"
    return expr


def has_data(result: list[dict[str, Any]], *, moved: bool = False) -> bool:
    """Something Grafana would draw: at least one finite value (NaN is a gap); with
    ``moved``, at least one that is not 0 (a rate or increase that shows the event)."""
    values = [s["value"][1] for s in result if "value" in s] + [v[1] for s in result for v in s.get("values", [])]
    return any(math.isfinite(float(value)) and (not moved or float(value) != 0) for value in values)


def panel_targets(dashboard: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for panel in data_panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target


def firing_alerts(prometheus: PrometheusServer, demos: list[DemoBridge]) -> set[tuple[str, str]]:
    """(alert name, demo scenario) of every firing alert (the rules keep job and instance)."""
    scenarios = {f"127.0.0.1:{demo.port}": demo.scenario for demo in demos}
    return {(alert["labels"]["alertname"], scenarios.get(alert["labels"].get("instance", ""), "?"))
            for alert in prometheus.get("/api/v1/alerts")["data"]["alerts"] if alert["state"] == "firing"}


@pytest.fixture
def demo_prometheus(tmp_path: Path) -> Iterator[tuple[PrometheusServer, list[DemoBridge], float]]:
    """A Prometheus scraping one gated demo per scenario (tests/gated_demo.py); the faults
    are released once Prometheus has stored every bridge's state before its fault."""
    required_binary("prometheus")
    started = time.time()
    ports: dict[str, int] = {}
    demos: list[DemoBridge] = []
    prometheus: PrometheusServer | None = None
    try:
        # One demo at a time, each port picked just before the process that binds it
        # starts and every port of a demo bound before the next one picks: the demos are
        # processes of their own, each handing out ports from this worker's slice without
        # knowing the others' picks, and two started together could pick the same port
        # between a probe and the bind (a demo then failed to start its controller).
        for scenario in DEMO_SCENARIOS:
            port = ports[scenario] = free_port()
            log = tmp_path / f"demo-{scenario}.log"
            with log.open("wb") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", "tests.gated_demo", "demo", "--scenario", scenario, "--hold", "600",
                     "--metrics-port", str(port)], stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                    cwd=ROOT, env={**os.environ, "STATE_DIRECTORY": str(tmp_path / f"state-{scenario}")})
            demo = DemoBridge(scenario, port, process, log)
            demos.append(demo)
            eventually_sync(demo.at_gate, timeout=90, what=f"the {scenario} demo subscribed")
        prometheus = PrometheusServer(tmp_path, ports)
        eventually_sync(prometheus.ready, timeout=60, what="prometheus ready")
        gated = time.time()
        eventually_sync(lambda: prometheus.scalar(f"count(timestamp(tft_bridge_build_info) > {gated})") == len(demos),
                        timeout=30, what="a scrape of every bridge before its fault")
        for demo in demos:
            demo.release()
        yield prometheus, demos, started
    finally:
        for demo in demos:
            demo.stop()
        if prometheus is not None:
            prometheus.stop()


@pytest.mark.timeout(240)
def test_dashboard_against_a_real_prometheus(
        demo_prometheus: tuple[PrometheusServer, list[DemoBridge], float], dashboard: dict[str, Any]) -> None:
    prometheus, demos, started = demo_prometheus
    eventually_sync(lambda: all(demo.held() for demo in demos), timeout=120, what="every demo scenario finished")
    done = time.time()
    # Scrapes of every bridge more than two intervals after its scenario ended, so the end
    # state is stored and a series born at the very end has the two samples rate() needs
    # (`up` is written for every scrape, also of a bridge that ended with its controller).
    settled = done + 2 * SCRAPE_INTERVAL
    eventually_sync(lambda: prometheus.scalar(f"count(timestamp(up) > {settled})") == len(demos),
                    timeout=30, what="scrapes of every demo bridge after its scenario")
    end = time.time()
    variables = grafana_variables(started, end)
    step = variables["$__interval"]

    errors: list[str] = []
    empty: set[tuple[str, str]] = set()
    for title, target in panel_targets(dashboard):
        expr = substitute(target["expr"], variables)
        if target.get("instant"):
            body = prometheus.get("/api/v1/query", query=expr, time=end)
        else:
            body = prometheus.get("/api/v1/query_range", query=expr, start=started, end=end, step=step)
        if body.get("status") != "success":
            errors.append(f"{title} {target['refId']}: {body.get('errorType')}: {body.get('error')}\n    {expr}")
        elif not has_data(body["data"]["result"], moved=bool(RATE_ARG.search(expr))):
            empty.add((title, target["refId"]))
    assert not errors, "dashboard expressions Prometheus rejects:\n" + "\n".join(errors)
    unexpected = sorted(empty - NEVER_MOVED.keys() - BORN_AT_FIRST_EVENT.keys() - node_row_targets(dashboard))
    assert not unexpected, f"panels without data after the demo scenarios: {unexpected}"
    exprs_by_target = {(title, target["refId"]): target["expr"] for title, target in panel_targets(dashboard)}
    for key in empty - node_row_targets(dashboard):
        expr = substitute(exprs_by_target[key], variables)
        if key in NEVER_MOVED:
            moved = prometheus.get("/api/v1/query", query=f"{METRIC.findall(expr)[0]} > 0", time=end)  # any series
            assert moved["data"]["result"] == [], f"{key} is listed as never moved, but it did: {moved}"
        else:
            shown = prometheus.get("/api/v1/query_range", query=expr, start=started, end=end, step=step)
            assert has_data(shown["data"]["result"]), f"{key}: not even its series exist"

    # The rule file on the same data: every rule evaluates cleanly, and the recoveries that
    # did not keep the job whole raise their alerts (the others stay quiet).
    expected = {("TftBridgeRecoveryFailed", "retry-fails")}
    # dump and exit end the controller, and the bridge then exits (code 76) within about
    # 0.1 s, taking its metrics endpoint with it: Prometheus has their last cycle only when
    # a scrape fell into that gap. Their alert is expected where it did; where it did not,
    # the test says so (a bridge that stays up for one last scrape would make this strict).
    for scenario in ("dump", "exit"):
        stored = f'max(max_over_time(tft_bridge_recovery_cycles_total{{strategy="{scenario}", scenario="{scenario}"}}[10m]))'
        if prometheus.scalar(stored) == 1:
            expected.add(("TftBridgeRecoveryStoppedJob", scenario))
        else:
            warnings.warn(f"the {scenario} demo's bridge exited before Prometheus scraped its last cycle", stacklevel=1)
    try:
        eventually_sync(lambda: expected <= firing_alerts(prometheus, demos), timeout=60, what="the demo's alerts firing")
    except AssertionError as error:
        raise AssertionError(f"{error}\nfiring: {sorted(firing_alerts(prometheus, demos))}\n"
                             + "\n".join(demo.output()[-3000:] for demo in demos)) from None
    unhealthy = [(rule["name"], rule.get("lastError")) for group in prometheus.get("/api/v1/rules")["data"]["groups"]
                 for rule in group["rules"] if rule["health"] != "ok"]
    assert not unhealthy, unhealthy
    # The dump and exit bridges have exited (76): on a slow run their targets can have been
    # down for TftBridgeDown's 2 minutes by now. Nothing else may fire.
    ended = {("TftBridgeDown", "dump"), ("TftBridgeDown", "exit")}
    firing = firing_alerts(prometheus, demos)
    assert expected <= firing and not firing - expected - ended, sorted(firing)

    # The dashboard's annotation marks the firing alerts on every graph: over the same
    # range it shows at least the one that is certain to fire.
    for annotation in dashboard["annotations"]["list"]:
        expr = substitute(annotation["expr"], variables)
        body = prometheus.get("/api/v1/query_range", query=expr, start=started, end=time.time(), step=step)
        assert body.get("status") == "success", body
        shown = {series["metric"]["alertname"] for series in body["data"]["result"]}
        assert "TftBridgeRecoveryFailed" in shown, (annotation["name"], shown)

    # The template variables' queries, the way Grafana runs label_values().
    jobs = prometheus.get("/api/v1/label/job/values", **{"match[]": "tft_bridge_build_info"}, start=started, end=end)
    assert jobs["data"] == ["tft-bridge-demo"]
    instances = prometheus.get("/api/v1/label/instance/values", **{"match[]": 'tft_bridge_build_info{job=~".*"}'},
                               start=started, end=end)
    assert sorted(instances["data"]) == sorted(f"127.0.0.1:{demo.port}" for demo in demos)


# --------------------------------------------------------------------------- the node row, on a real node
#
# The node row's panels against a real `tft-bridge node` process (the stand-in API server,
# the session launcher, real bridges with the stub controller, as tests/nodesim.py runs
# them), scraped by a real Prometheus. The run: a job served (a bridge started), a job
# refused (its pod not on the host network: a refusal and its Event), a graceful restart
# of the API server (the watch cut at its end, lists refused, then back), a restart of the
# node service (the running bridge adopted), the served job deleted (its bridge stopped).

NODE_JOB = "tft-bridge-node"
#: Node-row counters this run does not move; the test checks that they stayed at 0.
NODE_NEVER_MOVED: dict[tuple[str, str], str] = {
    ("Refusals, Events, adoptions and internal errors", "D"): "nothing fails inside a clean node service",
}
#: Node-row counters whose label values are open-ended (not pre-created): the series is
#: born at its first event already at 1, so increase() shows 0 for it. The test checks
#: that the series exists (the panel draws it at 0).
NODE_BORN_AT_FIRST_EVENT: dict[tuple[str, str], str] = {
    ("Bridge starts, exits and stops", "B"): "the one bridge exit of the run is its exit code's first",
}


@pytest.mark.timeout(300)
def test_node_row_against_a_real_prometheus(tmp_path: Path, dashboard: dict[str, Any]) -> None:
    pytest.importorskip("kubernetes")
    from bridge.sim.kube.apiserver import StandInApiServer
    from bridge.sim.kube.ascendjob import SimJob, SimJobs

    from .nodesim import LoggedProcess, NodeRig, rigs

    required_binary("prometheus")
    started = time.time()
    served = SimJob("served", pods=2, devices_per_pod=4, ttp_port=free_port())
    refused = SimJob("refused", ttp_port=free_port(), host_network=False)
    clusterd_port, metrics_port = free_port(), free_port()
    clusterd = LoggedProcess([sys.executable, "-m", "bridge.cli", "sim-clusterd", "--listen",
                              f"127.0.0.1:{clusterd_port}", "--job", served.uid, "--world-size", "8",
                              "--devices-per-pod", "4", "--keepalive", "0.5", "--phase-delay", "0.1"],
                             tmp_path / "clusterd.log")
    server = StandInApiServer().start()
    prometheus = PrometheusServer(tmp_path, {"node-1": metrics_port}, job_name=NODE_JOB)
    try:
        clusterd.wait_for("simulated ClusterD")
        cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
        with rigs(NodeRig(server, tmp_path / "state", f"127.0.0.1:{clusterd_port}")) as (rig,):
            rig.config_path.write_text(rig.config_path.read_text().replace(
                "[metrics]\nport = 0", f"[metrics]\nport = {metrics_port}"))
            rig.spawn()
            eventually_sync(prometheus.ready, timeout=60, what="prometheus ready")

            def scraped_since(moment: float) -> bool:
                return prometheus.scalar(f"count(timestamp(tft_bridge_node_build_info) > {moment})") == 1

            at = time.time()  # every counter stored at 0 before anything happens
            eventually_sync(lambda: scraped_since(at), timeout=60, what="a scrape of the node service")
            cluster.create(served)
            cluster.create(refused)
            pid = rig.wait_running(served)["pid"]
            eventually_sync(lambda: prometheus.scalar(f'tft_bridge_node_job_scrape_up{{tft_job="{served.uid}"}}')
                            == 1, timeout=60, what="the bridge's series relayed and stored")
            eventually_sync(lambda: prometheus.scalar('sum(tft_bridge_node_refused_jobs)') == 1, timeout=60,
                            what="the refusal stored")
            server.terminate(0.5)  # the API server restarted gracefully, down until the test brings it back
            assert server.wait_stopped(10)
            failed = 'tft_bridge_node_watch_restarts_total{reason="error"}'  # born at 1: stored, then seen rising
            first = eventually_sync(lambda: prometheus.scalar(failed), timeout=60, what="a watch error stored")
            eventually_sync(lambda: (prometheus.scalar(failed) or 0) > first, timeout=60,
                            what="the retries while the API server is down stored")
            server.start()
            eventually_sync(lambda: prometheus.scalar("tft_bridge_node_watch_up") == 1, timeout=60,
                            what="the watch back, stored")
            assert rig.process is not None
            rig.process.send_signal(signal.SIGTERM)  # the node service restarted: its bridge keeps running
            rig.process.wait(timeout=30)
            rig.spawn()
            eventually_sync(lambda: prometheus.scalar("tft_bridge_node_bridges_adopted_total") == 1, timeout=60,
                            what="the adoption stored")
            assert rig.running() == {served.uid: pid}
            cluster.delete(served)
            rig.wait_stopped(served)
            eventually_sync(lambda: prometheus.scalar("sum(tft_bridge_node_bridge_stops_total)") == 1
                            and prometheus.scalar("sum(tft_bridge_node_bridge_exits_total)"), timeout=60,
                            what="the stop and the exit stored")
            settled = time.time() + 2 * SCRAPE_INTERVAL  # the end state in two scrapes (rate() needs two)
            eventually_sync(lambda: scraped_since(settled), timeout=30, what="scrapes after the run")
            end = time.time()
            variables = grafana_variables(started, end)
            step = variables["$__interval"]
            row = node_row_targets(dashboard)
            errors: list[str] = []
            empty: list[tuple[str, str]] = []
            for title, target in panel_targets(dashboard):
                if (title, target["refId"]) not in row:
                    continue
                expr = substitute(target["expr"], variables)
                if target.get("instant"):
                    body = prometheus.get("/api/v1/query", query=expr, time=end)
                else:
                    body = prometheus.get("/api/v1/query_range", query=expr, start=started, end=end, step=step)
                moved = bool(RATE_ARG.search(expr)) and (title, target["refId"]) not in \
                    NODE_NEVER_MOVED.keys() | NODE_BORN_AT_FIRST_EVENT.keys()
                if body.get("status") != "success":
                    errors.append(f"{title} {target['refId']}: {body.get('errorType')}: {body.get('error')}")
                elif not has_data(body["data"]["result"], moved=moved):
                    empty.append((title, target["refId"]))
            assert not errors, "node-row expressions Prometheus rejects:\n" + "\n".join(errors)
            assert not empty, f"node-row panels without data after a node-mode run: {empty}"
            exprs_by_target = {(title, target["refId"]): target["expr"] for title, target in panel_targets(dashboard)}
            for key in NODE_NEVER_MOVED:
                series = METRIC.findall(exprs_by_target[key])[0]
                moved_at_all = prometheus.get("/api/v1/query", query=f"{series} > 0", time=end)["data"]["result"]
                assert moved_at_all == [], f"{key} is listed as never moved, but it did: {moved_at_all}"
            jobs = prometheus.get("/api/v1/label/tft_job/values",
                                  **{"match[]": f'tft_bridge_build_info{{job="{NODE_JOB}"}}'}, start=started, end=end)
            assert jobs["data"] == [served.uid]  # the $tft_job variable's values: the served job only
    finally:
        prometheus.stop()
        server.stop()
        clusterd.close()
