"""What an operator meets running ``tft-bridge node``: the node file checked key by key
(the selector as the API server parses it), credentials errors that name the file and
the next step, ``node-kubeconfig.sh`` refusing a kubeconfig without a token, the pod
watch's log lines, the stop rule, time-bound retries of a given-up job, HTTPS on the
node endpoint, and an RBAC that grants exactly the calls the code makes."""

from __future__ import annotations

import logging
import os
import re
import ssl
import stat
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bridge.cli import main
from bridge.node.config import DEFAULT_SELECTOR, build_node_config
from bridge.node.kube import credentials_problem
from bridge.node.selector import selector_problem

from .conftest import eventually_sync
from .processes import ROOT

yaml = pytest.importorskip("yaml")

CONTRIB = ROOT / "contrib" / "kubernetes"


# --------------------------------------------------------------------------- the node file

@pytest.mark.parametrize("selector", [
    DEFAULT_SELECTOR, "tft-bridge/enabled==true", "a=b,c!=d", "env in (prod, dev),!legacy", "tier notin (a)",
    "tft-bridge/enabled", "!example.com/off", "a=", "gpu>3", "app.kubernetes.io/name=x-y_z.1"])
def test_selectors_the_api_server_accepts_pass(selector: str) -> None:
    assert selector_problem(selector) is None


@pytest.mark.parametrize("selector, says", [
    ("tft-bridge/enabled=true=x", "found '='"),
    ("a=b c", "found 'c'"),
    ("a in ()", "cannot be empty"),
    ("a in (x", "expected ',' or ')'"),
    ("a in x", "'in' must be followed by '('"),
    ("-a=1", "not a valid label name"),
    ("Example.com/a=1", "invalid prefix"),
    ("a=" + "v" * 64, "not a valid label value"),
    ("a=b,", "expected a label key"),
    ("!a=b", "found '='"),
    ("gpu>x", "needs an integer"),
    ("   ", "empty"),
])
def test_selectors_the_api_server_refuses_are_refused(selector: str, says: str) -> None:
    why = selector_problem(selector)
    assert why is not None and says in why, why


DIFFERENTIAL = ["a in (x,)", "a,b", "a = b", "a in(x)", "x=y,z notin (q, r)", "a!b", "a=(b)", "a/b/c=1", "/a=1",
                "a/=1", "k" * 64, "p" * 254 + "/a", "a=b,,c", "a notin (x y)"]


@pytest.mark.parametrize("selector", DIFFERENTIAL + [DEFAULT_SELECTOR, "tft-bridge/enabled=true=x", "a in ()",
                                                     "Example.com/a=1", "gpu>3", "gpu>x", "!a=b"])
def test_the_check_and_the_stand_in_api_server_agree(selector: str) -> None:
    """Two parsers written apart from the same grammar -- the node file's check and the
    stand-in API server's (bridge/sim/kube/selectors.py) -- accept the same selectors."""
    from bridge.sim.kube.selectors import LabelSelector, SelectorError

    try:
        LabelSelector.parse(selector)
        served = True
    except SelectorError:
        served = False
    assert (selector_problem(selector) is None) == served, selector_problem(selector)


def write_node_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


def test_check_reports_every_bad_key_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_node_file(tmp_path, """
log_level = "VERBOSE"
[node]
selector = "tft-bridge/enabled=true=x"
tick = 0
restart_delay = -1
refusal_retry = -5
[kubernetes]
request_timeout = 0
server = "127.0.0.1:8001"
[metrics]
certfile = "/nonexistent/cert.pem"
""")
    assert main(["node", "--config", str(path), "--check"]) == 2
    lines = [line.strip() for line in capsys.readouterr().err.splitlines()[1:]]
    by_key = {line.split(":")[0].split(" ")[0]: line for line in lines}
    assert set(by_key) == {"log_level", "node.selector", "node.tick", "node.restart_delay", "node.refusal_retry",
                           "kubernetes.request_timeout", "kubernetes.server", "metrics.certfile"}, lines
    assert "expected one of DEBUG, INFO" in by_key["log_level"]
    assert "must be 0 or more" in by_key["node.restart_delay"] and "got -1" in by_key["node.restart_delay"]
    assert "must be more than 0" in by_key["node.tick"] and "busy loop" in by_key["node.tick"]
    assert "the API server would refuse" in by_key["node.selector"]
    assert "give both" in by_key["metrics.certfile"]


def test_a_bad_log_level_is_exit_2_without_a_traceback(tmp_path: Path) -> None:
    path = write_node_file(tmp_path, 'log_level = "verbose"\n[kubernetes]\nserver = "http://127.0.0.1:1"\n')
    result = subprocess.run([sys.executable, "-m", "bridge.cli", "node", "--config", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    assert "log_level: expected one of" in result.stderr and "Traceback" not in result.stderr


def test_a_plain_http_endpoint_on_a_node_address_is_warned(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = write_node_file(tmp_path, '[metrics]\naddress = "10.1.2.3"\n')
    assert main(["node", "--config", str(path), "--check"]) == 0
    err = capsys.readouterr().err
    assert "warning: metrics.address: '10.1.2.3' is reachable from other hosts" in err and "client_cafile" in err
    path.write_text('[metrics]\naddress = "127.0.0.1"\n')
    assert main(["node", "--config", str(path), "--check"]) == 0
    assert "warning" not in capsys.readouterr().err


# --------------------------------------------------------------------------- credentials

KUBECONFIG = """apiVersion: v1
kind: Config
clusters:
  - name: cluster
    cluster: {{server: "https://10.0.0.1:6443", certificate-authority-data: "{ca}"}}
users:
  - name: tft-bridge-node
    user: {{token: {token}}}
contexts:
  - name: tft-bridge-node
    context: {{cluster: cluster, user: tft-bridge-node}}
current-context: tft-bridge-node
"""


def test_credentials_problems_name_the_file_and_the_next_step(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    why = credentials_problem(str(missing), "", "", "/etc/tft-bridge/node.toml")
    assert why and str(missing) in why and "node-kubeconfig.sh" in why and "does not exist" in why
    why = credentials_problem("/run/credentials/tft-bridge-node.service/kubeconfig", "", "", "node.toml")
    assert why and "LoadCredential=" in why and "247" in why
    empty = tmp_path / "empty"
    empty.write_text("")
    why = credentials_problem(str(empty), "", "", "node.toml")
    assert why and f"{empty} is empty" in why and "node-kubeconfig.sh" in why
    no_token = tmp_path / "no-token"
    no_token.write_text(KUBECONFIG.format(ca="", token='""'))  # what the script wrote from an unfilled Secret
    why = credentials_problem(str(no_token), "", "", "node.toml")
    assert why and "has no token" in why and "tft-bridge-node-token" in why
    good = tmp_path / "good"
    good.write_text(KUBECONFIG.format(ca="Q0E=", token="abc.def"))
    assert credentials_problem(str(good), "", "", "node.toml") is None
    why = credentials_problem(str(good), "other", "", "node.toml")
    assert why and "no context 'other'" in why
    why = credentials_problem("", "", "", "/etc/tft-bridge/node.toml", env={})
    assert why and "/etc/tft-bridge/node.toml" in why and "kubernetes.kubeconfig is not set" in why
    assert credentials_problem("", "", "http://127.0.0.1:8001", "node.toml") is None


def test_missing_credentials_are_exit_2_with_the_file_named(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("")
    path = write_node_file(tmp_path, f'[kubernetes]\nkubeconfig = "{kubeconfig}"\n[node]\nstate_root = '
                                     f'"{tmp_path / "state"}"\n')
    result = subprocess.run([sys.executable, "-m", "bridge.cli", "node", "--config", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{kubeconfig} is empty" in result.stderr and "Traceback" not in result.stderr


# --------------------------------------------------------------------------- node-kubeconfig.sh

FAKE_KUBECTL = """#!/bin/sh
# kubectl as the script calls it: get secret ... -o jsonpath='{.data.token}{" "}{.data.ca\\.crt}'
[ -f "$FAKE_SECRET" ] || { echo 'Error from server (NotFound): secrets "tft-bridge-node-token" not found' >&2; exit 1; }
cat "$FAKE_SECRET"
"""


@pytest.fixture
def fake_kubectl(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(FAKE_KUBECTL)
    kubectl.chmod(kubectl.stat().st_mode | stat.S_IEXEC)
    secret = tmp_path / "secret"
    yield {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SECRET": str(secret)}, secret


def run_script(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(CONTRIB / "node-kubeconfig.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=30, check=False)


def test_node_kubeconfig_waits_for_the_token_and_the_ca(fake_kubectl: tuple[dict[str, str], Path],
                                                        tmp_path: Path) -> None:
    env, secret = fake_kubectl
    output = tmp_path / "node-kubeconfig"
    result = run_script(env, "https://10.0.0.1:6443", str(output))
    assert result.returncode == 1 and "kubectl apply -f contrib/kubernetes/rbac.yaml" in result.stderr
    secret.write_text(" ")  # created, not filled by the token controller yet
    result = run_script(env, "https://10.0.0.1:6443", str(output))
    assert result.returncode == 1 and result.stdout == "" and not output.exists()
    assert "no token and ca.crt yet" in result.stderr and "Wait until" in result.stderr
    secret.write_text("YWJjLmRlZg== ")  # a token, no CA
    result = run_script(env, "https://10.0.0.1:6443")
    assert result.returncode == 1 and result.stdout == "" and "no ca.crt yet" in result.stderr
    secret.write_text("YWJjLmRlZg== Q0EtREFUQQ==")
    result = run_script(env, "https://10.0.0.1:6443", str(output))
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(output.stat().st_mode) == 0o600
    document = yaml.safe_load(output.read_text())
    assert document["users"][0]["user"]["token"] == "abc.def"
    assert document["clusters"][0]["cluster"]["certificate-authority-data"] == "Q0EtREFUQQ=="
    assert credentials_problem(str(output), "", "", "node.toml") is None
    assert run_script(env, "10.0.0.1:6443").returncode == 2


# --------------------------------------------------------------------------- RBAC

VERBS = {"list": "list", "read": "get", "create": "create", "patch": "patch", "replace": "update",
         "delete": "delete"}


def code_api_calls() -> set[tuple[str, str]]:
    """(verb, resource) of every CoreV1Api call in the node service's code: ``self._core.X``,
    a list passed to ``open_watch`` being a watch."""
    calls: set[tuple[str, str]] = set()
    for path in (ROOT / "bridge" / "node").glob("*.py"):
        text = path.read_text()
        for watched, method in re.findall(r"(open_watch\(\s*)?self\._core\.([a-z_]+)", text):
            action, _, rest = method.partition("_")
            kind = re.sub(r"^(namespaced_)?|(_for_all_namespaces)$", "", rest)
            resource = {"pod": "pods", "node": "nodes", "event": "events", "pod_status": "pods/status"}.get(kind, kind)
            calls.add(("watch" if watched else VERBS[action], resource))
    return calls


def granted() -> set[tuple[str, str]]:
    role = next(d for d in yaml.safe_load_all((CONTRIB / "rbac.yaml").read_text()) if d["kind"] == "ClusterRole")
    return {(verb, resource) for rule in role["rules"] for verb in rule["verbs"] for resource in rule["resources"]}


def test_the_rbac_grants_exactly_the_calls_the_code_makes() -> None:
    calls = code_api_calls()
    assert {("watch", "pods"), ("get", "nodes"), ("create", "events")} <= calls  # the scan finds them
    assert granted() == calls, f"granted but unused: {granted() - calls}; used but not granted: {calls - granted()}"


def test_the_rbac_check_catches_an_extra_grant(tmp_path: Path) -> None:
    calls = code_api_calls()
    assert granted() | {("patch", "events")} != calls


# --------------------------------------------------------------------------- the watch's log lines

class FlakyApi:
    """list fails ``failures`` times with ``error``, then answers; a watch blocks until closed."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures = failures
        self.error = error

    def list(self, namespace: str | None, selector: str | None) -> tuple[list[dict[str, Any]], str]:
        if self.failures:
            self.failures -= 1
            raise self.error
        return [], "1"

    def watch(self, namespace: str | None, selector: str | None, resource_version: str, timeout: int) -> Any:
        return BlockingStream()


class BlockingStream:
    def __init__(self) -> None:
        self._closed = threading.Event()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._closed.wait(30)
        return iter(())

    def close(self) -> None:
        self._closed.set()


def watch_log(caplog: pytest.LogCaptureFixture, failures: int, error: Exception) -> list[logging.LogRecord]:
    from bridge.core.backoff import Backoff
    from bridge.node.metrics import NodeMetrics
    from bridge.core.kube_watch import ListWatcher

    metrics = NodeMetrics()
    deaths: list[BaseException] = []
    watcher = ListWatcher(FlakyApi(failures, error), None, DEFAULT_SELECTOR, lambda _: None, metrics,
                          on_death=deaths.append, backoff=Backoff(0.01, 0.02), what="Pod")
    with caplog.at_level(logging.INFO, logger="tft_bridge.platform.watch"):
        watcher.start()
        try:
            eventually_sync(lambda: metrics.watch_up._value.get() == 1, 10, "the watch open")
        finally:
            watcher.stop()
    assert deaths == []  # a requested stop is not a death
    return [r for r in caplog.records if r.name == "tft_bridge.platform.watch"]


class WatchBug(BaseException):
    """What the watch loop does not catch: its thread dies."""


class DyingApi:
    node_name = "node-1"

    def list(self, namespace: str | None, selector: str | None) -> tuple[list[dict[str, Any]], str]:
        raise WatchBug("the list loop itself failed")

    def event(self, *args: Any) -> None:
        pass


def test_a_dying_pod_watch_stops_the_node_service_with_exit_1(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    from bridge.node.metrics import NodeMetrics
    from bridge.node.service import NodeService

    config = build_node_config({"node": {"state_root": str(tmp_path / "state")}})
    service = NodeService(config, DyingApi(), launcher=None, metrics=NodeMetrics(),  # type: ignore[arg-type]
                          bridge_argv=lambda path: [], resolve=lambda name: None)
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(service.run()), daemon=True)
    with caplog.at_level(logging.ERROR, logger="tft_bridge.node"):
        runner.start()
        runner.join(20)
    assert result == [1]  # no request_stop: the watch's death ended it
    assert service.failure is not None and "pod watch" in service.failure
    assert any("node service ended" in r.getMessage() for r in caplog.records)


def test_a_watch_back_after_failures_says_so_at_info(caplog: pytest.LogCaptureFixture) -> None:
    from bridge.core.kube import Unavailable

    records = watch_log(caplog, 2, Unavailable("MaxRetryError: connection refused"))
    failed = [r for r in records if "list/watch failed" in r.getMessage()]
    assert len(failed) == 2 and all(r.levelno == logging.WARNING for r in failed)  # one line per retry
    back = [r for r in records if "is back" in r.getMessage()]
    assert len(back) == 1 and back[0].levelno == logging.INFO and "2 failed attempt(s)" in back[0].getMessage()


def test_a_403_at_start_is_not_called_an_rbac_error_until_it_lasts(caplog: pytest.LogCaptureFixture) -> None:
    from bridge.core.kube import RequestFailed
    from bridge.core.kube_watch import AUTH_GRACE, failure_level

    records = watch_log(caplog, 1, RequestFailed("HTTP 403 Forbidden: pods is forbidden", 403))
    refused = [r for r in records if "list/watch failed" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.WARNING
    assert "normal for a moment after the API server starts" in refused[0].getMessage()
    level, hint = failure_level(RequestFailed("HTTP 403", 403), AUTH_GRACE + 1)
    assert level == logging.ERROR and "RBAC" in hint
    level, hint = failure_level(RequestFailed("HTTP 401", 401), AUTH_GRACE + 1)
    assert level == logging.ERROR and "token" in hint
    assert failure_level(RequestFailed("HTTP 400 bad selector", 400), 0)[0] == logging.ERROR


# --------------------------------------------------------------------------- the stop rule and retries

class FakeProcess:
    def __init__(self) -> None:
        self.terminated = 0

    def poll(self) -> int | None:
        return None

    def terminate(self) -> None:
        self.terminated += 1


class NoApi:
    node_name = "node-1"

    def event(self, *args: Any) -> None:
        pass


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Any]:
    from bridge.node.metrics import NodeMetrics
    from bridge.node.service import NodeService

    config = build_node_config({"node": {"state_root": str(tmp_path / "state"), "ranks_leave_wait": 30.0,
                                         "refusal_retry": 100.0}})
    made = NodeService(config, NoApi(), launcher=None, metrics=NodeMetrics(),  # type: ignore[arg-type]
                       bridge_argv=lambda path: [], resolve=lambda name: None)
    yield made


def served(port: int) -> Any:
    from bridge.node.launcher import Record
    from bridge.node.service import Served

    record = Record(job_id="uid-1", pod_uid="pod-1", namespace="ns", pod_name="p-0", bind_ip="127.0.0.1", port=8000,
                    metrics_port=port, launcher="session")
    return Served(None, record, Path("/nonexistent"), FakeProcess(), stop_evidence="deleted", stop_since=1000.0)


def closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_unanswered_rank_count_is_not_zero(service: Any) -> None:
    """The stop waits while the bridge does not answer how many ranks are connected, up to
    node.ranks_leave_wait, as it does while ranks are connected."""
    job = served(closed_port())
    service._maybe_terminate("uid-1", job, 1000.0 + 5)
    assert job.process.terminated == 0 and not job.terminated
    service._maybe_terminate("uid-1", job, 1000.0 + 30)  # the bound
    assert job.process.terminated == 1 and service.metrics.stops.labels("deleted")._value.get() == 1


def test_a_bridge_with_no_rank_connected_is_stopped_at_once(service: Any) -> None:
    from prometheus_client import CollectorRegistry, Gauge

    from bridge.core.metrics_http import MetricsServer
    from bridge.node.service import RANKS_GAUGE

    class Registry:
        registry = CollectorRegistry()

    gauge = Gauge(RANKS_GAUGE, "ranks", registry=Registry.registry)
    gauge.set(2)
    endpoint = MetricsServer(Registry(), "127.0.0.1", 0)
    endpoint.start()
    try:
        job = served(endpoint.port)
        service._maybe_terminate("uid-1", job, 1000.0 + 1)
        assert job.process.terminated == 0  # two ranks attached
        gauge.set(0)
        service._maybe_terminate("uid-1", job, 1000.0 + 2)
        assert job.process.terminated == 1
    finally:
        endpoint.stop()


def test_a_given_up_job_is_tried_again_after_refusal_retry(service: Any) -> None:
    service._pods = {"pod-1": {"metadata": {"uid": "pod-1", "name": "p-0", "namespace": "ns"}},
                     "pod-2": {"metadata": {"uid": "pod-2", "name": "q-0", "namespace": "ns"}}}
    service._give_up("pod-1", "bridge_config", 500.0)
    service._given_up["pod-2"] = ""  # an operator's stop
    service._reported.add(("pod-1", "bridge_config"))
    service._retry_given_up(599.0)
    assert service._given_up == {"pod-1": "bridge_config", "pod-2": ""}
    service._retry_given_up(600.0)
    assert service._given_up == {"pod-2": ""}  # the operator's stop is never retried
    assert ("pod-1", "bridge_config") not in service._reported  # a new failure is reported again


# --------------------------------------------------------------------------- HTTPS on the node endpoint

def test_the_node_endpoint_serves_https_with_client_certificates(tmp_path: Path) -> None:
    trustme = pytest.importorskip("trustme")
    pytest.importorskip("kubernetes")
    from bridge.sim.kube.apiserver import StandInApiServer

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    (tmp_path / "server.pem").write_bytes(b"".join(p.bytes() for p in cert.cert_chain_pems))
    (tmp_path / "server.key").write_bytes(cert.private_key_pem.bytes())
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    from bridge.sim.kube.ascendjob import SimJobs

    with StandInApiServer() as server:
        SimJobs(server.store, {"node-1": "127.0.0.1"})  # node-1's kubelet registers its Node
        path = write_node_file(tmp_path, f"""
[node]
name = "node-1"
state_root = "{tmp_path / 'state'}"
launcher = "session"
[kubernetes]
server = "{server.url}"
[metrics]
port = 0
certfile = "{tmp_path / 'server.pem'}"
keyfile = "{tmp_path / 'server.key'}"
client_cafile = "{tmp_path / 'ca.pem'}"
""")
        log = tmp_path / "node.log"
        with log.open("w") as out:
            process = subprocess.Popen([sys.executable, "-m", "bridge.cli", "node", "--config", str(path)], cwd=ROOT,
                                       stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            found = eventually_sync(lambda: re.search(r"metrics on https://127\.0\.0\.1:(\d+)/metrics",
                                                      log.read_text()), 60, "the node endpoint")
            url = f"https://127.0.0.1:{found.group(1)}/metrics"
            context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
            with pytest.raises(Exception):  # no client certificate: refused
                urllib.request.urlopen(url, context=context, timeout=10).read()
            ca.issue_cert("prometheus").configure_cert(context)
            with urllib.request.urlopen(url, context=context, timeout=10) as response:
                assert b"tft_bridge_node_build_info" in response.read()
        finally:
            process.terminate()
            process.wait(timeout=30)


def test_an_api_server_away_costs_one_log_line_per_retry(tmp_path: Path) -> None:
    """``tft-bridge node`` against an API server that is not there: each retry is the
    watch's one WARNING line, without urllib3's own retry warnings beside it (beside the
    one line at start that says the node name could not be checked)."""
    pytest.importorskip("kubernetes")
    path = write_node_file(tmp_path, f"""
[node]
name = "node-1"
state_root = "{tmp_path / 'state'}"
launcher = "session"
[kubernetes]
server = "http://127.0.0.1:{closed_port()}"
connect_timeout = 1.0
[metrics]
enabled = false
""")
    log = tmp_path / "node.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "bridge.cli", "node", "--config", str(path)], cwd=ROOT,
                                   stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        eventually_sync(lambda: log.read_text().count("list/watch failed") >= 3, 60, "three failed retries")
    finally:
        process.terminate()
        process.wait(timeout=30)
    text = log.read_text()
    warnings = [line for line in text.splitlines() if "WARNING" in line and "cannot check that node" not in line]
    assert warnings and all("list/watch failed" in line for line in warnings), "\n".join(warnings)
    assert text.count("cannot check that node") == 1
    assert "Retrying" not in text
