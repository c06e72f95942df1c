"""From a pod to its bridge, on pod dicts as ascend-operator makes them (no API server):
which pod hosts the controller, what each variable becomes, and what is refused."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bridge.node.jobconfig import dumps, job_raw, validated
from bridge.node.podspec import JobSpec, Refusal, evaluate, framework_of
from bridge.platform.sim.ascendjob import SimJob, pod_object

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
    assert judge(SimJob("pt"), index=1) is None  # RANK=1: a worker, none of the service's business
    spec = judge(SimJob("ms", framework="mindspore", pods=3, devices_per_pod=8))
    assert isinstance(spec, JobSpec) and spec.framework == "mindspore" and spec.world_size == 24
    assert judge(SimJob("ms", framework="mindspore"), index=1) is None
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
    pod = pod_object(SimJob("a"), 0, "node-1", "")
    pod["status"].pop("hostIP")
    unknown = evaluate(pod, host_ip="", clusterd_address="", resolve=lambda name: None)
    assert isinstance(unknown, Refusal) and unknown.reason == "host_ip_unknown"
    assert isinstance(evaluate(pod, host_ip="10.0.0.21", clusterd_address="", resolve=lambda n: None), JobSpec)


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
