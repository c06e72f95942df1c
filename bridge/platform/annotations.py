"""The PodGroup annotation keys of ClusterD's platform mode and a typed view of one PodGroup.

Every key, value and "who writes it" fact comes from the real ClusterD (see
docs/clusterd.md section 10), not from its public docs, which differ:

* ``ProcessRecoverStrategy`` (platform): its *presence* at the job's first Init turns
  platform mode on. ClusterD polls it at fault time and accepts only ``retry``,
  ``recover`` or ``dump``; at the confirm step it re-reads it and also accepts ``exit``.
* ``ProcessConfirmFault`` (ClusterD): written only when empty or absent, never cleared.
* ``ProcessResultFault`` (platform): ClusterD waits for the key to *exist*; never cleared.
* ``RankTableReady`` (platform): read for ``recover``; ``"true"`` proceeds, any other
  non-empty value fails at once, absent or empty waits 300 s and then fails.
* ``ProcessRecoverStatus`` (ClusterD): one of :data:`STATUSES`, never cleared.
* label ``process-recover-enable``: ClusterD sets it to ``pause`` and back to ``on`` in
  its FaultRetry state, the tail of every cycle that ends in exit, 508 or 509.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GROUP = "scheduling.volcano.sh"
VERSION = "v1beta1"
PLURAL = "podgroups"

STRATEGY = "ProcessRecoverStrategy"
CONFIRM = "ProcessConfirmFault"
RESULT = "ProcessResultFault"
RANK_TABLE_READY = "RankTableReady"
STATUS = "ProcessRecoverStatus"
ENABLE_LABEL = "process-recover-enable"
PAUSED = "pause"

#: The keys this agent reports on (the ``key`` label of the malformed-annotation metric).
KEYS = (STRATEGY, CONFIRM, RESULT, RANK_TABLE_READY, STATUS)

#: Values ClusterD accepts while it waits at fault time (anything else keeps it waiting).
FAULT_TIME_STRATEGIES = ("retry", "recover", "dump")
#: Values ClusterD accepts when it re-reads the strategy at the confirm step.
CONFIRM_STRATEGIES = ("retry", "recover", "dump", "exit")

#: Statuses after which ClusterD's cycle is over.
FINAL_STATUSES = ("retry-success", "recover-success", "dump-success", "dump-failed", "exit-completed")
#: Statuses after which ClusterD goes on within the same cycle: a failed retry either
#: goes back through the confirm step (code 405) or on to recover/dump/exit; a failed
#: recover goes on to dump or exit.
INTERIM_STATUSES = ("retry-failed", "recover-failed")
STATUSES = FINAL_STATUSES + INTERIM_STATUSES


@dataclass(frozen=True)
class PodGroupView:
    """The parts of a PodGroup object the agent reads, copied out of the API's JSON.

    Built from the raw dict (never from a client model class) so the agent works the
    same on the official client's output, the stand-in's and a test's literal.
    """

    namespace: str
    name: str
    uid: str
    resource_version: str
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> PodGroupView:
        meta = obj.get("metadata") or {}
        return cls(
            namespace=str(meta.get("namespace") or ""),
            name=str(meta.get("name") or ""),
            uid=str(meta.get("uid") or ""),
            resource_version=str(meta.get("resourceVersion") or ""),
            annotations=_strings(meta.get("annotations")),
            labels=_strings(meta.get("labels")),
        )

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name

    @property
    def platform_mode(self) -> bool:
        """ClusterD's own test: the strategy key exists (whatever its value)."""
        return STRATEGY in self.annotations

    @property
    def strategy(self) -> str:
        return self.annotations.get(STRATEGY, "")

    @property
    def confirm(self) -> str:
        """The raw confirm text; ClusterD calls it "set" when its length is non-zero."""
        return self.annotations.get(CONFIRM, "")

    @property
    def has_result(self) -> bool:
        return RESULT in self.annotations

    @property
    def status(self) -> str:
        return self.annotations.get(STATUS, "")

    @property
    def paused(self) -> bool:
        return self.labels.get(ENABLE_LABEL) == PAUSED


def _strings(value: object) -> dict[str, str]:
    """Annotations and labels are string maps; anything else in them is ignored."""
    if not isinstance(value, Mapping):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, str)}


def resource_version_newer(candidate: str, reference: str) -> bool | None:
    """Whether ``candidate`` is a later resourceVersion than ``reference``.

    resourceVersions are opaque by contract, so this answers only when both are decimal
    integers (what etcd-backed API servers hand out) and ``None`` otherwise; callers must
    then fall back to the order in which they saw the events.
    """
    if candidate.isascii() and candidate.isdigit() and reference.isascii() and reference.isdigit():
        return int(candidate) > int(reference)
    return None
