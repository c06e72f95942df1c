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
drive the node service through the API server alone.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .apiserver import PODS, PodGroupStore

OPT_IN = {"tft-bridge/enabled": "true"}


@dataclass
class SimJob:
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


def pod_object(job: SimJob, index: int, node: str, host_ip: str) -> dict[str, Any]:
    """Pod ``index`` of ``job`` bound to ``node`` (hostIP ``host_ip``), Pending as bound."""
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
        "spec": {"nodeName": node, "hostNetwork": host_network,
                 "containers": [{"name": "ascend", "image": "training:latest", "env": env}]},
        "status": {"phase": "Pending", "hostIP": host_ip,
                   "podIP": host_ip if host_network else f"10.244.0.{index + 2}"},
    }


class SimJobs:
    """The job lifecycle on a :class:`PodGroupStore`, as the cluster changes it."""

    def __init__(self, store: PodGroupStore, nodes: Mapping[str, str]) -> None:
        self.store = store
        self.nodes = dict(nodes)  # node name -> host IP

    def create(self, job: SimJob, placement: Mapping[int, str] | None = None) -> list[dict[str, Any]]:
        """Every pod of ``job``, pod i on ``placement[i]`` (default: the first node)."""
        first = next(iter(self.nodes))
        return [self.store.create_object(PODS, pod_object(job, i, (placement or {}).get(i, first),
                                                            self.nodes[(placement or {}).get(i, first)]))
                for i in range(job.pods)]

    def pod(self, job: SimJob, index: int = 0) -> dict[str, Any]:
        return self.store.get(job.namespace, pod_name(job, index), PODS)

    def set_phase(self, job: SimJob, phase: str, index: int = 0) -> dict[str, Any]:
        return self.store.patch(job.namespace, pod_name(job, index), {"status": {"phase": phase}}, PODS)

    def delete(self, job: SimJob, index: int | None = None) -> None:
        for i in range(job.pods) if index is None else [index]:
            try:
                self.store.delete(job.namespace, pod_name(job, i), PODS)
            except Exception:  # already gone
                pass

    def reschedule(self, job: SimJob, node: str, index: int = 0) -> dict[str, Any]:
        """Pod ``index`` deleted and made again on ``node`` (a new pod UID, the same job)."""
        self.delete(job, index)
        return self.store.create_object(PODS, pod_object(job, index, node, self.nodes[node]))

    def restart(self, job: SimJob) -> list[dict[str, Any]]:
        """The whole job made again under the same UID (ascend-operator's reschedule:
        every pod new, ``version`` + 1): a new incarnation of the job."""
        placement = {i: self.pod(job, i)["spec"]["nodeName"] for i in range(job.pods)}
        self.delete(job)
        job.version += 1
        return self.create(job, placement)
