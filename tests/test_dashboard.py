"""The Grafana dashboard may query only metrics the bridge exports, and with their real labels.

The exported names come from a live ``BridgeMetrics`` registry. Every labelled metric is
touched once, so its samples exist under the names prometheus_client gives them
(``_total`` for counters, ``_bucket``/``_sum``/``_count`` for histograms, ``_info`` for
Info, gauges unchanged). Renaming or removing a metric therefore breaks this test until
the dashboard follows.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from bridge.metrics import BridgeMetrics

DASHBOARD = Path(__file__).resolve().parent.parent / "contrib" / "grafana" / "tft-bridge.json"

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

def exported_samples() -> dict[str, set[str]]:
    """Every sample name a bridge exposes, mapped to its label names."""
    metrics = BridgeMetrics()
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
    return {family.name for family in BridgeMetrics().registry.collect()}


@pytest.fixture(scope="module")
def samples() -> dict[str, set[str]]:
    found = exported_samples()
    # The touching worked: one name of every kind is present, with its labels.
    assert "tft_bridge_clusterd_rpcs_total" in found and found["tft_bridge_clusterd_rpcs_total"] == {"method", "code"}
    assert "tft_bridge_recovery_duration_seconds_bucket" in found
    assert "tft_bridge_build_info" in found and {"version", "codec"} <= found["tft_bridge_build_info"]
    assert "tft_bridge_subscription_up" in found
    return found


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
    assert {"job", "instance"} <= set(variables)
    for name in ("job", "instance"):
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
    missing = sorted(family for family in exported_families()
                     if not any(name == family or name.startswith(family + "_") for name in used))
    assert not missing, f"metrics without a panel: {missing}"
