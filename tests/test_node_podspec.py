"""From a pod to its bridge, on pod dicts as ascend-operator makes them (no API server):
which pod hosts the controller, what each variable becomes, and what is refused."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bridge.node.jobconfig import dumps, job_raw, validated
from bridge.node.podspec import HostIpPending, Ignored, JobSpec, Refusal, evaluate, framework_of
from bridge.sim.kube.ascendjob import SimJob, pod_object

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def judge(job: SimJob, index: int = 0, host_ip: str = "", clusterd: str = "",
          resolve: Callable[[str], str | None] = lambda name: None) -> JobSpec | Refusal | None:
    pod = pod_object(job, index, "node-1", "10.0.0.21")
    pod["metadata"]["uid"] = f"pod-{index}"
    return evaluate(pod, host_ip=host_ip, clusterd_address=clusterd, resolve=resolve)


def test_only_rank_0s_pod_or_the_mindspore_scheduler_hosts_the_controller() -> None:
    assert isinstance(judge(SimJob("pt")), JobSpec)
    worker = judge(SimJob("pt"), index=1)  # RANK=1: a worker, none of the service's business
    assert isinstance(worker, Ignored) and worker.reason == "not_controller" and not worker.notify
    spec = judge(SimJob("ms", framework="mindspore", pods=3, devices_per_pod=8))
    assert isinstance(spec, JobSpec) and spec.framework == "mindspore" and spec.world_size == 24
    scheduler_worker = judge(SimJob("ms", framework="mindspore"), index=1)
    assert isinstance(scheduler_worker, Ignored) and scheduler_worker.reason == "not_controller"
    assert framework_of({"MS_ROLE": "MS_WORKER", "RANK": "0"}) is None  # a MindSpore worker with a RANK


def test_every_value_comes_from_the_pod() -> None:
    job = SimJob("pt", ttp_port=8123, clusterd_ip="10.96.0.20",
                 extra_env={"HIGH_AVAILABILITY": "elastic-training,other", "MINDIO_WAIT_MINDX_TIME": "45"})
    spec = judge(job)
    assert isinstance(spec, JobSpec)
    assert (spec.job_id, spec.pod_uid, spec.bind_ip, spec.port, spec.world_size) == (job.uid, "pod-0", "10.0.0.21",
                                                                                      8123, 8)
    assert (spec.enable_arf, spec.enable_zit, spec.wait_mindx_time) == (True, True, 45)
    assert spec.clusterd_address == "10.96.0.20:8899"
    assert judge(SimJob("pt", process_recover=False)).enable_arf is None  # absent: the bridge's default (off)
    assert judge(job, clusterd="10.0.0.9:8899").clusterd_address == "10.0.0.9:8899"  # the node's word wins
    named = judge(SimJob("pt", clusterd_ip="clusterd-grpc-svc.mindx-dl.svc.cluster.local"),
                  resolve=lambda name: "10.96.0.7" if name.startswith("clusterd-grpc-svc") else None)
    assert named.clusterd_address == "10.96.0.7:8899"
    v6 = judge(SimJob("pt", clusterd_ip="fd00::20"))
    assert v6.clusterd_address == "[fd00::20]:8899"


@pytest.mark.parametrize(("job", "reason"), [
    (SimJob("a", host_network=False), "not_host_network"),
    (SimJob("a", extra_env={"MINDX_TASK_ID": "x"}), "ids_disagree"),
    (SimJob("a", world_size=None), "no_world_size"),
    (SimJob("a", extra_env={"WORLD_SIZE": "8x"}), "bad_value"),
    (SimJob("a", extra_env={"PROCESS_RECOVER": "maybe"}), "bad_value"),
    (SimJob("a", taskd_off=False), "taskd_controller"),
    (SimJob("a", clusterd_ip=""), "no_clusterd"),
    (SimJob("a", clusterd_ip="nowhere.invalid"), "clusterd_unresolvable"),
])
def test_refusals(job: SimJob, reason: str) -> None:
    result = judge(job)
    assert isinstance(result, Refusal) and result.reason == reason, result


def test_a_value_from_a_secret_is_never_guessed() -> None:
    pod = pod_object(SimJob("a"), 0, "node-1", "10.0.0.21")
    env = pod["spec"]["containers"][0]["env"]
    env[:] = [e for e in env if e["name"] != "WORLD_SIZE"]
    env.append({"name": "WORLD_SIZE", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "ws"}}})
    result = evaluate(pod, host_ip="", clusterd_address="", resolve=lambda name: None)
    assert isinstance(result, Refusal) and result.reason == "bad_value" and "WORLD_SIZE" in result.message


def test_host_ip_rules() -> None:
    assert judge(SimJob("a"), host_ip="10.0.0.21").bind_ip == "10.0.0.21"
    mismatch = judge(SimJob("a"), host_ip="10.0.0.99")
    assert isinstance(mismatch, Refusal) and mismatch.reason == "host_ip_mismatch"
    pod = pod_object(SimJob("a"), 0, "node-1", "")  # bound; the kubelet has written no status yet
    assert "hostIP" not in pod["status"]
    unknown = evaluate(pod, host_ip="", clusterd_address="", resolve=lambda name: None)
    assert isinstance(unknown, HostIpPending)  # waited for, not refused
    assert unknown.refusal.reason == "host_ip_unknown" and unknown.refusal.pod_name == pod["metadata"]["name"]
    assert isinstance(evaluate(pod, host_ip="10.0.0.21", clusterd_address="", resolve=lambda n: None), JobSpec)


def test_world_size_falls_back_to_ms_worker_num_as_the_bridge_does() -> None:
    """WORLD_SIZE empty, MS_WORKER_NUM set: the bridge itself reads MS_WORKER_NUM
    (bridge/core/config.py), so the node service must too, not refuse bad_value."""
    from bridge.core.config import build_config

    job = SimJob("a", extra_env={"MS_WORKER_NUM": "16"})
    pod = pod_object(job, 0, "node-1", "10.0.0.21")
    env = pod["spec"]["containers"][0]["env"]
    next(e for e in env if e["name"] == "WORLD_SIZE")["value"] = ""
    spec = evaluate(pod, host_ip="", clusterd_address="", resolve=lambda name: None)
    assert isinstance(spec, JobSpec) and spec.world_size == 16
    bridge = build_config({}, env={"MINDX_TASK_ID": job.uid, "WORLD_SIZE": "", "MS_WORKER_NUM": "16"})
    assert bridge.controller.world_size == spec.world_size
    # A WORLD_SIZE that is set wins over MS_WORKER_NUM, as in the bridge.
    next(e for e in env if e["name"] == "WORLD_SIZE")["value"] = "8"
    assert evaluate(pod, host_ip="", clusterd_address="", resolve=lambda name: None).world_size == 8


def test_local_proxy_and_hccl_timeout_reach_the_bridge_as_it_reads_them(tmp_path: Path) -> None:
    """LOCAL_PROXY_ENABLE=on: ClusterD through its node-local proxy; HCCL_CONNECT_TIMEOUT:
    the pause timeout; both exactly as the bridge derives them from its own environment."""
    from bridge.core.config import build_config

    job = SimJob("a", clusterd_ip="10.96.0.20", extra_env={"LOCAL_PROXY_ENABLE": "on", "HCCL_CONNECT_TIMEOUT": "120"})
    spec = judge(job)
    assert isinstance(spec, JobSpec)
    config = validated(job_raw(spec, {}, tmp_path / "job", 40123))
    expected = build_config({}, env={"MINDX_TASK_ID": job.uid, "MINDX_SERVER_IP": "10.96.0.20",
                                     "LOCAL_PROXY_ENABLE": "on", "HCCL_CONNECT_TIMEOUT": "120"})
    assert config.clusterd.address == expected.clusterd.address == "127.0.0.1:8899"
    assert config.controller.pause_timeout == expected.controller.pause_timeout == 300
    other = judge(SimJob("a", clusterd_ip="10.96.0.20", extra_env={"LOCAL_PROXY_ENABLE": "yes"}))
    assert other.clusterd_address == "10.96.0.20:8899"  # only exactly "on", TaskD's test
    assert judge(SimJob("a"), clusterd="10.0.0.9:8899").clusterd_address == "10.0.0.9:8899"  # the node's word
    bad = judge(SimJob("a", extra_env={"HCCL_CONNECT_TIMEOUT": "soon"}))
    assert isinstance(bad, Refusal) and bad.reason == "bad_value" and "HCCL_CONNECT_TIMEOUT" in bad.message


def test_a_pod_without_mindx_task_id_or_rank_is_not_silently_ignored() -> None:
    no_id = pod_object(SimJob("a"), 0, "node-1", "10.0.0.21")
    env = no_id["spec"]["containers"][0]["env"]
    env[:] = [e for e in env if e["name"] != "MINDX_TASK_ID"]
    refused = evaluate(no_id, host_ip="", clusterd_address="", resolve=lambda name: None)
    assert isinstance(refused, Refusal) and refused.reason == "ids_disagree" and "MINDX_TASK_ID" in refused.message
    no_rank = pod_object(SimJob("a"), 0, "node-1", "10.0.0.21")
    env = no_rank["spec"]["containers"][0]["env"]
    env[:] = [e for e in env if e["name"] != "RANK"]
    ignored = evaluate(no_rank, host_ip="", clusterd_address="", resolve=lambda name: None)
    assert isinstance(ignored, Ignored) and ignored.reason == "no_rank" and ignored.notify


def test_the_generated_file_is_what_the_bridge_loads(tmp_path: Path) -> None:
    spec = judge(SimJob("a", extra_env={"MINDIO_WAIT_MINDX_TIME": "45"}))
    template = {"clusterd": {"tls": False, "rpc_timeout": 2.5}, "hooks": {"node_command": ["/bin/x", "a b"]},
                "log_level": "DEBUG"}
    raw = job_raw(spec, template, tmp_path / "job", 40123)
    text = dumps(raw)
    assert tomllib.loads(text) == raw
    config = validated(tomllib.loads(text))
    assert config.job_id == spec.job_id and config.controller.wait_mindx_time == 45
    assert config.hooks.node_command == ("/bin/x", "a b") and config.clusterd.rpc_timeout == 2.5
    assert config.metrics.address == "127.0.0.1" and config.metrics.port == 40123
    assert template == {"clusterd": {"tls": False, "rpc_timeout": 2.5}, "hooks": {"node_command": ["/bin/x", "a b"]},
                        "log_level": "DEBUG"}  # the template itself is never changed
    with pytest.raises(ValueError):
        dumps({"x": float("nan")})
