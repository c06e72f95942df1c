"""The Prometheus rules in contrib/prometheus: well-formed, tested, and over real metrics.

``promtool check rules`` and ``promtool test rules`` are the judges of the rule file; this
module runs them (``tests/prometheus_bin.py``: skipped without promtool, required in CI)
and adds what promtool cannot know: every alert carries the annotations an on-call
engineer needs and a runbook anchor that exists in docs/runbook.md, every alert has a
unit test where it fires and one where it does not, and every metric and label a rule
uses is one the bridge exports (a renamed metric breaks this test until the rules follow).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml  # PyYAML: a dependency of the kubernetes client in the test extra

from .prometheus_bin import required_binary
from .test_dashboard import GROUPING, MATCHER, METRIC, SELECTOR, TARGET_LABELS, exported_samples, node_samples

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "contrib" / "prometheus" / "tft-bridge.rules.yml"
RULE_TESTS = ROOT / "contrib" / "prometheus" / "tft-bridge.rules.test.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"
SEVERITIES = {"critical", "warning", "info"}
RECORDED = re.compile(r"\b[a-z_]+:tft_bridge_[a-z0-9_]+:[a-z0-9_]+\b")


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def rules() -> list[dict[str, Any]]:
    return [rule for group in load(RULES)["groups"] for rule in group["rules"]]


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives headings: lower case, punctuation dropped, spaces to '-'."""
    anchors = set()
    for line in markdown.splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


# --------------------------------------------------------------------------- static checks

def test_every_alert_says_how_bad_what_and_where_to_read_on() -> None:
    anchors = github_anchors(RUNBOOK.read_text(encoding="utf-8"))
    found = alerts()
    assert len(found) >= 15
    for name, rule in found.items():
        assert rule["labels"]["severity"] in SEVERITIES, name
        notes = rule["annotations"]
        assert notes["summary"].strip() and notes["description"].strip(), name
        url = notes["runbook_url"]
        assert url == f"docs/runbook.md#{name.lower()}", f"{name}: runbook_url {url!r}"
        assert name.lower() in anchors, f"{name}: docs/runbook.md has no heading '{name}'"


def test_the_runbook_lists_exactly_the_alerts() -> None:
    """The runbook's summary table and its alert sections follow the rule file: no alert
    missing, no section left behind for an alert that was renamed or removed."""
    text = RUNBOOK.read_text(encoding="utf-8")
    names = set(alerts())
    listed = set(re.findall(r"^\| \[(TftBridge\w+)\]\(#(\w+)\)", text, re.MULTILINE))
    assert {name for name, _ in listed} == names
    assert all(anchor == name.lower() for name, anchor in listed)
    sections = set(re.findall(r"^### (TftBridge\w+)$", text, re.MULTILINE))
    assert sections == names


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in load(RULE_TESTS)["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = set(alerts())
    assert not names - fires, f"alerts never tested firing: {sorted(names - fires)}"
    assert not names - quiet, f"alerts never tested quiet: {sorted(names - quiet)}"
    assert not (fires | quiet) - names, f"tests of alerts that do not exist: {sorted((fires | quiet) - names)}"


def metric_problems(all_rules: list[dict[str, Any]], samples: dict[str, set[str]]) -> list[str]:
    recorded = {rule["record"] for rule in all_rules if "record" in rule}
    problems = []
    for rule in all_rules:
        where = rule.get("alert") or rule["record"]
        expr = rule["expr"]
        for name in RECORDED.findall(expr):
            if name not in recorded:
                problems.append(f"{where}: recording rule {name} is not defined")
        bare = RECORDED.sub("", expr)
        for name in METRIC.findall(bare):
            if name not in samples:
                problems.append(f"{where}: {name} is not exported")
        for name, matchers in SELECTOR.findall(bare):
            for label, _, _ in MATCHER.findall(matchers or ""):
                if label not in samples.get(name, set()) | TARGET_LABELS:
                    problems.append(f"{where}: {name} has no label {label!r}")
    return problems


def both_deployments() -> dict[str, set[str]]:
    """The samples a rule may use: a bridge's (as its own endpoint serves them, and as the
    node endpoint relays them with ``tft_job``) and the node service's own."""
    samples = {name: labels | {"tft_job"} for name, labels in exported_samples().items()}
    samples.update(node_samples())
    return samples


def test_rules_query_only_real_metrics_and_labels() -> None:
    problems = metric_problems(rules(), both_deployments())
    assert not problems, "\n".join(problems)


ON_CLAUSE = re.compile(r"\bon\s*\(([^)]*)\)")


def test_every_rule_keeps_the_bridges_of_a_node_apart() -> None:
    """A grouping or a match that names the instance also names ``tft_job``: on a node
    endpoint, one instance is every bridge of the node (with no ``tft_job`` -- a per-job
    unit -- the label is empty and changes nothing). The node service's own series are
    one per node."""
    problems = []
    for rule in rules():
        if all(name.startswith("tft_bridge_node_") for name in METRIC.findall(RECORDED.sub("", rule["expr"]))):
            continue
        for clause in GROUPING.findall(rule["expr"]) + ON_CLAUSE.findall(rule["expr"]):
            labels = {part.strip() for part in clause.split(",")}
            if "instance" in labels and "tft_job" not in labels:
                problems.append(f"{rule.get('alert') or rule['record']}: ({clause})")
    assert not problems, "\n".join(problems)


def test_the_node_service_is_watched() -> None:
    """Alerts on the node service's own series: a job without a bridge, a failing bridge,
    refusals, the pod watch."""
    used = {name for rule in alerts().values() for name in METRIC.findall(rule["expr"])}
    node = set(node_samples())
    for name in ("tft_bridge_node_job_bridge_running", "tft_bridge_node_job_scrape_up", "tft_bridge_node_refused_jobs",
                 "tft_bridge_node_watch_up"):
        assert name in node and name in used, name
    recorded = {rule["record"]: rule["expr"] for rule in rules() if "record" in rule}
    assert "tft_bridge_node_bridge_exits_total" in recorded["instance:tft_bridge_node_bridge_exits:increase15m"]


def test_a_misspelt_metric_label_or_recording_rule_is_caught() -> None:
    broken = [{"alert": "A", "expr": "tft_bridge_outbox_depht > 1"},
              {"alert": "B", "expr": 'tft_bridge_reports_dropped_total{reson="x"} > 0'},
              {"alert": "C", "expr": "instance:tft_bridge_no_such:increase10m > 0"}]
    problems = metric_problems(broken, both_deployments())
    assert len(problems) == 3 and [p[0] for p in problems] == ["A", "B", "C"], problems


# --------------------------------------------------------------------------- promtool

def promtool(*args: str, cwd: Path = RULES.parent) -> subprocess.CompletedProcess[str]:
    return subprocess.run([required_binary("promtool"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, check=False)


def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = promtool("test", "rules", RULE_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_catch_a_first_event_blind_rule(tmp_path: Path) -> None:
    """The unit tests can fail: with plain increase() -- blind to a counter that appears at
    1, the way the bridge's labelled counters do -- the first failed recovery goes unseen."""
    text = RULES.read_text(encoding="utf-8")
    blind = re.sub(r"\(tft_bridge_recovery_cycles_total \+ 0 unless [^)]*\)\s*or", "", text)
    assert blind != text
    (tmp_path / RULES.name).write_text(blind, encoding="utf-8")
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text(encoding="utf-8"), encoding="utf-8")
    result = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0
    assert "alertname: TftBridgeRecoveryFailed, time: 3m" in result.stdout + result.stderr
