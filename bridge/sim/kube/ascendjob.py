"""An AscendJob's pods as ascend-operator makes them, on the stand-in API server.

What the node service reads, with the values ascend-operator writes
(``component/ascend-operator/pkg/controllers/v1``): the controlling ownerReference to
the AscendJob (its UID), ``MINDX_TASK_ID`` = that UID, ``MINDX_SERVER_IP`` (ClusterD's
Service IP), ``WORLD_SIZE`` and ``RANK`` (PyTorch) or ``MS_WORKER_NUM``, ``MS_ROLE`` and
``MS_SCHED_HOST`` from ``status.podIP`` (MindSpore's Scheduler), the labels
``training.kubeflow.org/job-name``, ``replica-type``, ``replica-index`` and ``version``,
and ``PROCESS_RECOVER=on`` only for a job with a ``recover-strategy``. ``TTP_PORT``,
``TASKD_PROCESS_ENABLE``, ``PROCESSOR_ADDR``, ``MINDIO_WAIT_MINDX_TIME`` and
``hostNetwork`` come from the user's YAML (contrib/kubernetes/ascendjob-fragment.yaml).

:class:`SimJobs` creates, binds, ends, deletes and reschedules those pods the way the
scheduler, the kubelet and ascend-operator change them, so tests and the chaos runner
drive the node service through the API server alone: ascend-operator creates a pod
without a node or a status (the server sets ``phase: Pending``), the scheduler binds it
(``pods/x/binding``), the kubelet of that node writes its status through ``pods/x/status``
(``hostIP``, ``podIP``, ``Running``), and a deletion is graceful (``deletionTimestamp``)
until the kubelet, its containers ended, deletes it for good.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bridge.sim.kube.apiserver import NODES, PODS, ApiError, PodGroupStore

OPT_IN = {"tft-bridge/enabled": "true"}


@dataclass
class SimJob:
    """One AscendJob: its name, UID, framework, pods and the values ascend-operator and the
    user's YAML put in them (:meth:`SimJobs.create` makes its pods)."""


    name: str
    namespace: str = "default"
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    framework: str = "pytorch"  # or mindspore
    pods: int = 2
    devices_per_pod: int = 4
    ttp_port: int = 8000
    clusterd_ip: str = "127.0.0.1"
    host_network: bool = True
    taskd_off: bool = True
    process_recover: bool = True
    world_size: int | None = -1  # -1: pods x devices; None: not set (a vNPU job)
    extra_env: dict[str, str] = field(default_factory=dict)
    opt_in: bool = True
    version: int = 0  # the reschedule count ascend-operator labels pods with

    def size(self) -> int | None:
        return self.pods * self.devices_per_pod if self.world_size == -1 else self.world_size


def pod_name(job: SimJob, index: int) -> str:
    """``<job>-master-0`` (PyTorch) or ``<job>-scheduler-0`` (MindSpore), then ``<job>-worker-<i>``."""
    if index == 0:
        return f"{job.name}-{'scheduler' if job.framework == 'mindspore' else 'master'}-0"
    return f"{job.name}-worker-{index - 1}"


def pod_manifest(job: SimJob, index: int) -> dict[str, Any]:
    """Pod ``index`` of ``job`` as ascend-operator creates it: no node, no status."""
    size = job.size()
    env: list[dict[str, Any]] = [
        {"name": "MINDX_TASK_ID", "value": job.uid},
        {"name": "MINDX_SERVER_IP", "value": job.clusterd_ip},
        {"name": "TTP_PORT", "value": str(job.ttp_port)},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PROCESSOR_ADDR", "value": f"{job.name}-master-0"},
    ]
    if job.taskd_off:
        env.append({"name": "TASKD_PROCESS_ENABLE", "value": "off"})
    if job.process_recover:
        env.append({"name": "PROCESS_RECOVER", "value": "on"})
    if job.framework == "mindspore":
        if size is not None:
            env.append({"name": "MS_WORKER_NUM", "value": str(size)})
        if index == 0:
            env += [{"name": "MS_ROLE", "value": "MS_SCHED"},
                    {"name": "MS_SCHED_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        else:
            env.append({"name": "MS_ROLE", "value": "MS_WORKER"})
    else:
        if size is not None:
            env.append({"name": "WORLD_SIZE", "value": str(size)})
        env.append({"name": "RANK", "value": str(index)})
    env += [{"name": k, "value": v} for k, v in job.extra_env.items()]
    replica = "Scheduler" if job.framework == "mindspore" and index == 0 else ("Master" if index == 0 else "Worker")
    host_network = job.host_network
    labels = {"training.kubeflow.org/job-name": job.name, "training.kubeflow.org/replica-type": replica.lower(),
              "training.kubeflow.org/replica-index": str(index), "version": str(job.version)}
    if job.opt_in:
        labels.update(OPT_IN)
    return {
        "metadata": {
            "name": pod_name(job, index), "namespace": job.namespace, "labels": labels,
            "ownerReferences": [{"apiVersion": "mindxdl.gitee.com/v1", "kind": "AscendJob", "name": job.name,
                                 "uid": job.uid, "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {"hostNetwork": host_network,
                 "containers": [{"name": "ascend", "image": "training:latest", "env": env}]},
    }


def kubelet_status(job: SimJob, index: int, host_ip: str, phase: str = "Running") -> dict[str, Any]:
    """The status the kubelet of the pod's node writes once it runs the pod."""
    pod_ip = host_ip if job.host_network else f"10.244.0.{index + 2}"
    return {"phase": phase, "hostIP": host_ip, "hostIPs": [{"ip": host_ip}], "podIP": pod_ip,
            "podIPs": [{"ip": pod_ip}], "startTime": "2026-01-01T00:00:00Z"}


def pod_object(job: SimJob, index: int, node: str, host_ip: str) -> dict[str, Any]:
    """Pod ``index`` of ``job`` as the API server shows it once bound to ``node`` and
    started by its kubelet (hostIP ``host_ip``; "" = the kubelet has written no status yet)."""
    pod = pod_manifest(job, index)
    pod["spec"]["nodeName"] = node
    pod["status"] = kubelet_status(job, index, host_ip) if host_ip else {"phase": "Pending"}
    return pod


class SimJobs:
    """The job lifecycle on a :class:`PodGroupStore`, as the cluster changes it: every
    write goes through the store's API rules (create, binding, status, graceful delete)."""

    def __init__(self, store: PodGroupStore, nodes: Mapping[str, str]) -> None:
        self.store = store
        self.nodes = dict(nodes)  # node name -> host IP
        for node, ip in self.nodes.items():  # each node's kubelet registers its Node
            try:
                store.create_object(NODES, {"metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}},
                                            "status": {"addresses": [{"type": "InternalIP", "address": ip},
                                                                     {"type": "Hostname", "address": node}]}})
            except ApiError as error:
                if error.code != 409:
                    raise

    def create(self, job: SimJob, placement: Mapping[int, str] | None = None,
               run: bool = True) -> list[dict[str, Any]]:
        """Every pod of ``job``: created, bound to ``placement[i]`` (default: the first node),
        and (``run``) started by that node's kubelet; the pods as they are now."""
        first = next(iter(self.nodes))
        pods = []
        for i in range(job.pods):
            node = (placement or {}).get(i, first)
            self.store.create_object(PODS, pod_manifest(job, i))
            pods.append(self.place(job, i, node, run))
        return pods

    def place(self, job: SimJob, index: int, node: str, run: bool = True) -> dict[str, Any]:
        """The scheduler binds pod ``index`` to ``node``; its kubelet starts it (``run``)."""
        pod = self.store.bind(job.namespace, pod_name(job, index), node)
        return self.run(job, index) if run else pod

    def run(self, job: SimJob, index: int = 0, phase: str = "Running") -> dict[str, Any]:
        """The kubelet of the pod's node writes its status (hostIP, podIP, ``phase``)."""
        node = self.pod(job, index)["spec"]["nodeName"]
        return self.store.patch(job.namespace, pod_name(job, index),
                                {"status": kubelet_status(job, index, self.nodes[node], phase)}, PODS, "status")

    def pod(self, job: SimJob, index: int = 0) -> dict[str, Any]:
        return self.store.get(job.namespace, pod_name(job, index), PODS)

    def set_phase(self, job: SimJob, phase: str, index: int = 0) -> dict[str, Any]:
        return self.store.patch(job.namespace, pod_name(job, index), {"status": {"phase": phase}}, PODS, "status")

    def delete(self, job: SimJob, index: int | None = None, finish: bool = True) -> None:
        """A graceful delete of the pods (``deletionTimestamp``); with ``finish``, the
        kubelet's final delete once their containers ended (the pods gone)."""
        for i in range(job.pods) if index is None else [index]:
            for grace in ((None, 0) if finish else (None,)):
                try:
                    self.store.delete(job.namespace, pod_name(job, i), PODS, grace)
                except ApiError as error:  # already gone
                    if error.code != 404:
                        raise

    def reschedule(self, job: SimJob, node: str, index: int = 0) -> dict[str, Any]:
        """Pod ``index`` deleted and made again on ``node`` (a new pod UID, the same job)."""
        self.delete(job, index)
        self.store.create_object(PODS, pod_manifest(job, index))
        return self.place(job, index, node)

    def restart(self, job: SimJob) -> list[dict[str, Any]]:
        """The whole job made again under the same UID (ascend-operator's reschedule:
        every pod new, ``version`` + 1): a new incarnation of the job."""
        placement = {i: self.pod(job, i)["spec"]["nodeName"] for i in range(job.pods)}
        self.delete(job)
        job.version += 1
        return self.create(job, placement)
