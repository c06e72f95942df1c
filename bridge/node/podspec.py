"""From one pod, as the API server shows it, to the bridge its job needs, or a refusal.

Pure: no I/O but the optional name lookup passed in, so every rule is tested on pod
dicts. The facts each rule rests on (MindCluster's source):

* TaskD starts the controller in rank 0's pod only: PyTorch, the pod whose ``RANK`` is
  ``0``; MindSpore, the Scheduler pod (``MS_ROLE=MS_SCHED``, whose ``MS_SCHED_HOST`` is
  its own ``status.podIP``). Every other pod of a job needs no bridge.
* ascend-operator writes the env into the container that carries ``MINDX_TASK_ID`` (its
  default container) and sets ``MINDX_TASK_ID`` to the AscendJob's UID, which is also
  ClusterD's job id and the pods' controlling ownerReference UID. The two must agree, or
  the bridge would report to ClusterD under a job id ClusterD does not know.
* World size: ``WORLD_SIZE`` (PyTorch), or ``MS_WORKER_NUM`` (MindSpore) where
  ``WORLD_SIZE`` is absent or empty, exactly as TaskD and the bridge itself read it;
  absent for some jobs (vNPU, dynamic cut), then nothing is guessed.
* ``LOCAL_PROXY_ENABLE=on`` (exactly): ClusterD is reached through its node-local proxy,
  ``127.0.0.1:8899``, whatever ``MINDX_SERVER_IP`` says; ``HCCL_CONNECT_TIMEOUT`` sets
  the pause timeout as TaskD derives it (``bridge.core.config.pause_timeout_from_hccl``).
* A pod is created without a status; the kubelet writes ``status.hostIP`` once it runs
  the pod. A pod without it yet is waited for (``HostIpPending``), not refused.
* The ranks dial ``PROCESSOR_ADDR`` (the ``<job>-master-0`` Service, which selects pod 0)
  on ``TTP_PORT``: a bridge on the host is reachable there only when pod 0 uses
  ``hostNetwork`` and the bridge binds the host IP.
* ``TASKD_PROCESS_ENABLE`` not ``off`` means TaskD starts its own controller in the pod on
  the same address: two controllers, one port.
* ``MINDX_SERVER_IP`` is ClusterD's Service IP, or its DNS name when ascend-operator's
  lookup failed; a name the host cannot resolve is refused, not retried blind.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from bridge.core.config import LOCAL_PROXY_ADDRESS, pause_timeout_from_hccl

#: The reasons a job that opted in gets no bridge (label values of the refusal metric,
#: the Event's message prefix; docs/node-service.md lists each one).
REASONS = (
    "not_host_network",  # pod 0 does not use hostNetwork: the ranks cannot reach a bridge on the host
    "port_taken",  # TTP_PORT on the host IP is held by another process or another job's bridge
    "ids_disagree",  # MINDX_TASK_ID is not the pod's controlling owner UID (or either is missing)
    "no_world_size",  # neither WORLD_SIZE nor MS_WORKER_NUM
    "clusterd_unresolvable",  # MINDX_SERVER_IP is a name the host cannot resolve
    "no_clusterd",  # no MINDX_SERVER_IP and no clusterd.address in the node's configuration
    "taskd_controller",  # TASKD_PROCESS_ENABLE is not off: TaskD would start a second controller
    "bad_value",  # a value is malformed (a port, a number, PROCESS_RECOVER) or comes from a source the node cannot read
    "host_ip_unknown",  # neither node.host_ip nor the pod's status.hostIP, after node.host_ip_wait
    "host_ip_mismatch",  # the pod's hostIP is not node.host_ip
    "bridge_config",  # the bridge refused the configuration built for the job (tft-bridge run exit 2)
    "bridge_failing",  # the bridge failed to start too often (the unit's start limit)
)

#: Why an opted-in pod gets neither a bridge nor a refusal (label values of
#: tft_bridge_node_ignored_pods; docs/node-service.md lists each one).
IGNORED_REASONS = (
    "not_controller",  # a worker pod: TaskD starts the controller in rank 0's (or the Scheduler's) pod only
    "no_rank",  # the job's container has neither RANK nor MS_ROLE: which pod hosts the controller is unknown
    "host_ip_pending",  # the kubelet has not written status.hostIP yet (waited for, node.host_ip_wait)
    "terminal",  # Succeeded or Failed
    "deleting",  # deletionTimestamp set
)

DEFAULT_TTP_PORT = 8000  # the port MindCluster's guide and PROCESSOR_ADDR use
CLUSTERD_PORT = 8899


@dataclass(frozen=True)
class JobSpec:
    """What a job's bridge is started with; equal specs mean the same bridge."""

    job_id: str  # the AscendJob UID = MINDX_TASK_ID = ClusterD's job id
    pod_uid: str  # pod 0's UID: a new one is a new incarnation of the job
    namespace: str
    pod_name: str
    job_name: str  # training.kubeflow.org/job-name, for people
    framework: str  # pytorch or mindspore
    world_size: int
    bind_ip: str
    port: int
    enable_arf: bool | None  # PROCESS_RECOVER; None: not set, the bridge's default
    enable_zit: bool | None  # HIGH_AVAILABILITY contains elastic-training
    wait_mindx_time: int | None  # MINDIO_WAIT_MINDX_TIME
    clusterd_address: str  # HOST:PORT, an IP literal host
    pause_timeout: int | None = None  # from HCCL_CONNECT_TIMEOUT; None: not set, the bridge's default


@dataclass(frozen=True)
class Refusal:
    """An opted-in controller pod that gets no bridge, and why (one of REASONS)."""

    job_id: str
    pod_uid: str
    namespace: str
    pod_name: str
    reason: str
    message: str


@dataclass(frozen=True)
class Ignored:
    """An opted-in pod that gets no bridge and no refusal, and why (one of IGNORED_REASONS);
    ``notify``: the pod looks meant to be served, so an Event tells its owner."""

    pod_uid: str
    namespace: str
    pod_name: str
    reason: str
    message: str
    notify: bool = False


@dataclass(frozen=True)
class HostIpPending:
    """A controller pod whose ``status.hostIP`` the kubelet has not written yet: waited for;
    ``refusal`` is what it becomes if it never comes."""

    refusal: Refusal


Resolver = Callable[[str], str | None]  # a host name -> an IP literal, or None


def meta(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return pod.get("metadata") or {}


def pod_uid(pod: Mapping[str, Any]) -> str:
    return str(meta(pod).get("uid") or "")


def owner_uid(pod: Mapping[str, Any]) -> str:
    """The controlling ownerReference's UID (the AscendJob), else ""."""
    for ref in meta(pod).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller") and ref.get("uid"):
            return str(ref["uid"])
    return ""


def is_terminal(pod: Mapping[str, Any]) -> bool:
    """Succeeded or Failed: the pod's containers will not run again."""
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def job_container_env(pod: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    """The env of the container that carries MINDX_TASK_ID (else of the first container,
    the pod's default), with downward-API fields of the pod resolved; and the names whose
    value the node cannot read (ConfigMap, Secret, resource fields: never guessed)."""
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    containers = [c for c in spec.get("containers") or [] if isinstance(c, Mapping)]
    carrying = [c for c in containers
                if any(isinstance(e, Mapping) and e.get("name") == "MINDX_TASK_ID" for e in c.get("env") or [])]
    for container in (carrying or containers)[:1]:
        env = container.get("env") or []
        values: dict[str, str] = {}
        unreadable: list[str] = []
        for entry in env:
            if not isinstance(entry, Mapping) or not entry.get("name"):
                continue
            name = str(entry["name"])
            if "value" in entry and entry["value"] is not None:
                values[name] = str(entry["value"])
                continue
            field_path = ((entry.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
            if field_path == "status.podIP" and status.get("podIP"):
                values[name] = str(status["podIP"])
            elif field_path == "status.hostIP" and status.get("hostIP"):
                values[name] = str(status["hostIP"])
            elif field_path == "spec.nodeName" and spec.get("nodeName"):
                values[name] = str(spec["nodeName"])
            elif field_path == "metadata.name":
                values[name] = str(meta(pod).get("name") or "")
            elif field_path == "metadata.namespace":
                values[name] = str(meta(pod).get("namespace") or "")
            elif entry.get("valueFrom"):
                unreadable.append(name)
            else:
                values[name] = ""  # an env entry with neither: Kubernetes gives it ""
        return values, unreadable
    return {}, []


def framework_of(env: Mapping[str, str]) -> str | None:
    """``pytorch`` / ``mindspore`` when this pod is the one TaskD starts the controller in."""
    if env.get("MS_ROLE") == "MS_SCHED":
        return "mindspore"
    if "MS_ROLE" not in env and env.get("RANK", "").strip() == "0":
        return "pytorch"
    return None


def _int(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() else None


def _flag(text: str) -> bool | None:
    value = text.strip().lower()
    if value in ("on", "true", "1", "yes"):
        return True
    if value in ("off", "false", "0", "no", ""):
        return False
    return None


def evaluate(pod: Mapping[str, Any], *, host_ip: str, clusterd_address: str,
             resolve: Resolver) -> JobSpec | Refusal | HostIpPending | Ignored:
    """The bridge ``pod`` needs, a refusal, a wait for its host IP, or why it is ignored
    (a worker pod, a pod that does not say its rank).

    ``host_ip``: the node's configured IP ("" = the pod's ``status.hostIP``);
    ``clusterd_address``: the node's ``bridge.clusterd.address`` ("" = from the pod)."""
    env, unreadable = job_container_env(pod)
    framework = framework_of(env)
    m = meta(pod)
    if framework is None:
        ids = (pod_uid(pod), str(m.get("namespace") or ""), str(m.get("name") or ""))
        if "RANK" not in env and "MS_ROLE" not in env:
            return Ignored(*ids, "no_rank", "the pod carries the opt-in label but its container sets neither RANK "
                           "nor MS_ROLE, so which pod of the job hosts the controller is unknown: is it an "
                           "AscendJob's pod made by ascend-operator?", notify=True)
        return Ignored(*ids, "not_controller", "not the pod TaskD starts the controller in (RANK 0 or the "
                                               "MindSpore Scheduler)")
    job_id = env.get("MINDX_TASK_ID", "").strip()
    uid = pod_uid(pod)

    def refuse(reason: str, message: str) -> Refusal:
        return Refusal(job_id or owner_uid(pod), uid, str(m.get("namespace") or ""), str(m.get("name") or ""),
                       reason, message)

    owner = owner_uid(pod)
    if not job_id:
        return refuse("ids_disagree", f"no container of the pod carries MINDX_TASK_ID (the pod's controlling "
                                      f"owner UID is {owner!r}): ascend-operator sets it in every AscendJob "
                                      f"pod; ClusterD knows the job by that id, never guessed")
    if not owner or job_id != owner:
        return refuse("ids_disagree", f"MINDX_TASK_ID {job_id!r} is not the pod's controlling owner UID "
                                      f"{owner!r}: ClusterD knows the job by one id, never guessed")
    if (env.get("TASKD_PROCESS_ENABLE") or "on").strip().lower() != "off":
        return refuse("taskd_controller", "TASKD_PROCESS_ENABLE is not \"off\": TaskD would start its own "
                                          "controller on the same address (set TASKD_PROCESS_ENABLE=off)")
    if not (pod.get("spec") or {}).get("hostNetwork"):
        return refuse("not_host_network", "pod 0 does not use hostNetwork: the ranks reach the controller at "
                                          "pod 0's IP, which a bridge on the host cannot bind")
    important = {"WORLD_SIZE", "MS_WORKER_NUM", "TTP_PORT", "PROCESS_RECOVER", "HIGH_AVAILABILITY",
                 "MINDIO_WAIT_MINDX_TIME", "MINDX_SERVER_IP", "LOCAL_PROXY_ENABLE", "HCCL_CONNECT_TIMEOUT"}
    hidden = sorted(important.intersection(unreadable))
    if hidden:
        return refuse("bad_value", f"{', '.join(hidden)} come from a source the node service does not read "
                                   f"(ConfigMap, Secret or resource field): give them as values")
    # As the bridge reads them (bridge/core/config.py): MS_WORKER_NUM where WORLD_SIZE is absent or empty.
    size_name = "MS_WORKER_NUM" if not env.get("WORLD_SIZE") and "MS_WORKER_NUM" in env else \
        "WORLD_SIZE" if "WORLD_SIZE" in env else ""
    if not size_name:
        return refuse("no_world_size", "neither WORLD_SIZE nor MS_WORKER_NUM is set in the pod")
    world_size = _int(env[size_name])
    if world_size is None or world_size < 1:
        return refuse("bad_value", f"{size_name} {env[size_name]!r} is not a positive integer")
    port_text = env.get("TTP_PORT", str(DEFAULT_TTP_PORT))
    port = _int(port_text)
    if port is None or not 1024 <= port <= 65535:
        return refuse("bad_value", f"TTP_PORT {port_text!r} is not a port in 1024..65535")
    arf = _flag(env["PROCESS_RECOVER"]) if "PROCESS_RECOVER" in env else None
    if "PROCESS_RECOVER" in env and arf is None:
        return refuse("bad_value", f"PROCESS_RECOVER {env['PROCESS_RECOVER']!r} is neither on nor off")
    zit = "elastic-training" in env["HIGH_AVAILABILITY"] if "HIGH_AVAILABILITY" in env else None
    wait = None
    if "MINDIO_WAIT_MINDX_TIME" in env:
        wait = _int(env["MINDIO_WAIT_MINDX_TIME"])
        if wait is None:
            return refuse("bad_value", f"MINDIO_WAIT_MINDX_TIME {env['MINDIO_WAIT_MINDX_TIME']!r} is not an integer")
    pause = None
    if "HCCL_CONNECT_TIMEOUT" in env:
        derived = pause_timeout_from_hccl(env["HCCL_CONNECT_TIMEOUT"])
        if isinstance(derived, str):
            return refuse("bad_value", f"HCCL_CONNECT_TIMEOUT {derived!r} is not an integer")
        pause = derived
    pod_host = str((pod.get("status") or {}).get("hostIP") or "")
    bind_ip = host_ip or pod_host
    if not bind_ip:
        return HostIpPending(refuse("host_ip_unknown", "the kubelet has not written the pod's status.hostIP and "
                                                       "node.host_ip is not set"))
    if host_ip and pod_host and pod_host != host_ip:
        return refuse("host_ip_mismatch", f"the pod's hostIP {pod_host} is not this node's host_ip {host_ip}")
    address = clusterd_address
    if not address and env.get("LOCAL_PROXY_ENABLE") == "on":  # TaskD's exact test; wins over MINDX_SERVER_IP
        address = LOCAL_PROXY_ADDRESS
    if not address:
        server = env.get("MINDX_SERVER_IP", "").strip()
        if not server:
            return refuse("no_clusterd", "no MINDX_SERVER_IP in the pod and no bridge.clusterd.address "
                                         "in the node's configuration")
        ip = _ip_literal(server)
        if ip is None:
            ip = resolve(server)
            if ip is None:
                return refuse("clusterd_unresolvable", f"MINDX_SERVER_IP {server!r} is a name this host cannot "
                                                       f"resolve; set bridge.clusterd.address on the node")
        address = f"[{ip}]:{CLUSTERD_PORT}" if ":" in ip else f"{ip}:{CLUSTERD_PORT}"
    labels = m.get("labels") or {}
    return JobSpec(job_id=job_id, pod_uid=uid, namespace=str(m.get("namespace") or ""),
                   pod_name=str(m.get("name") or ""),
                   job_name=str(labels.get("training.kubeflow.org/job-name") or ""), framework=framework,
                   world_size=world_size, bind_ip=bind_ip, port=port, enable_arf=arf, enable_zit=zit,
                   wait_mindx_time=wait, clusterd_address=address, pause_timeout=pause)


def _ip_literal(text: str) -> str | None:
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        return None
