"""The platform policy: which ``ProcessRecoverStrategy`` to write, from a small TOML file.

The policy answers two questions and nothing else:

1. **Standing strategy**: the value kept on every platform-mode PodGroup between cycles.
   ClusterD reads the key *before* it tells anyone about a fault (it polls every 3 s for
   up to 300 s and sends no stopTrain meanwhile), so a platform that waits to be told
   about the fault never answers in time: the value must already be there. ``dump`` by
   default: the one strategy that is safe for any fault, and only used as the final
   word if the agent never gets to answer the confirm step. ``""`` means *hold*:
   ClusterD then waits for someone else to write a strategy (508 after 300 s), and the
   agent never writes a standing value.
2. **Answer strategy**: the value written together with ``ProcessResultFault`` when
   ClusterD asks to confirm the faults (ClusterD re-reads the strategy right after it
   sees the result, and then also accepts ``exit``). The first strategy of ``prefer``
   that applies wins:

   * ``retry`` applies when every confirmed fault has a type in ``retry_fault_types``
     (``[0]``: UCE only, the default; ``[0, 2]`` also retries HCCL faults) and the
     confirm is not the second one of a cycle whose retry already failed (ClusterD
     never retries twice; answering ``retry`` then would leave it only ``exit``);
   * ``recover`` applies when RankTableReady can be asserted: ``rank_table = "assert"``
     (the agent writes ``RankTableReady: "true"`` with the answer), or
     ``rank_table = "external"`` and another component already wrote ``"true"``;
     ``"never"`` disables it;
   * ``dump`` and ``exit`` always apply; if nothing applies the answer is ``exit``.

   A confirm ClusterD cannot use (poisoned by a non-integer rank, or with no readable
   fault) gets ``on_malformed`` (``dump`` or ``exit``) whatever ``prefer`` says:
   ClusterD would run retry or recover on **no ranks at all**.

``[defaults]`` holds the rules; ``[namespaces.<name>]`` overrides any of them for the
PodGroups of one namespace. See ``contrib/platform-policy.example.toml``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from bridge.core.config import ConfigError, read_toml
from bridge.platform.annotations import FAULT_TIME_STRATEGIES

PREFERABLE = ("retry", "recover", "dump", "exit")
RANK_TABLE_MODES = ("assert", "external", "never")
MALFORMED_CHOICES = ("dump", "exit")

RankTableWrite = Literal["true", "delete", "keep"]


class PolicyError(ConfigError):
    """Every problem of a policy file at once, one line per key."""

    title = "invalid platform policy"


@dataclass(frozen=True)
class Rules:
    """The rules for the PodGroups of one namespace (or the defaults)."""

    standing_strategy: str = "dump"
    prefer: tuple[str, ...] = ("retry", "recover", "dump")
    retry_fault_types: frozenset[int] = frozenset({0})
    rank_table: str = "assert"
    on_malformed: str = "dump"

    def as_dict(self) -> dict[str, Any]:
        return {
            "standing_strategy": self.standing_strategy,
            "prefer": list(self.prefer),
            "retry_fault_types": sorted(self.retry_fault_types),
            "rank_table": self.rank_table,
            "on_malformed": self.on_malformed,
        }


@dataclass(frozen=True)
class Policy:
    """The rules in force: ``defaults`` and per-namespace overrides; ``origin`` names the file."""
    defaults: Rules = field(default_factory=Rules)
    namespaces: Mapping[str, Rules] = field(default_factory=dict)
    origin: str = "built-in defaults"

    def rules_for(self, namespace: str) -> Rules:
        return self.namespaces.get(namespace, self.defaults)

    def as_dict(self) -> dict[str, Any]:
        return {
            "origin": self.origin,
            "defaults": self.defaults.as_dict(),
            "namespaces": {ns: rules.as_dict() for ns, rules in sorted(self.namespaces.items())},
        }


@dataclass(frozen=True)
class Situation:
    """What the agent knows when ClusterD asks it to confirm faults."""

    faults: Mapping[int, int]
    unusable: bool = False
    after_failed_retry: bool = False
    rank_table_ready: str = ""


@dataclass(frozen=True)
class Decision:
    """The answer to one confirm: the strategy, what to write to RankTableReady, and why (logged)."""
    strategy: str
    rank_table: RankTableWrite
    reason: str


def decide(rules: Rules, situation: Situation) -> Decision:
    """The answer strategy for one confirm step (see the module docstring)."""
    if situation.unusable:
        strategy = rules.on_malformed
        reason = "the confirmed faults are unreadable (poisoned or empty)"
    else:
        strategy, reason = "exit", "no preferred strategy applies"
        for candidate in rules.prefer:
            why = _applies(candidate, rules, situation)
            if why:
                strategy, reason = candidate, why
                break
    if rules.rank_table == "external":
        rank_table: RankTableWrite = "keep"
    else:
        rank_table = "true" if strategy == "recover" else "delete"
    return Decision(strategy, rank_table, reason)


def _applies(strategy: str, rules: Rules, situation: Situation) -> str:
    """Why ``strategy`` applies, or "" when it does not."""
    if strategy == "retry":
        if situation.after_failed_retry:
            return ""
        types = set(situation.faults.values())
        return "every fault is retryable" if types and types <= rules.retry_fault_types else ""
    if strategy == "recover":
        if rules.rank_table == "assert":
            return "RankTableReady asserted by the agent"
        if rules.rank_table == "external" and situation.rank_table_ready == "true":
            return "RankTableReady is true"
        return ""
    return "always applies"


# --------------------------------------------------------------------------- loading

_KEYS = {f.name for f in fields(Rules)}


def load_policy(path: str | Path | None) -> Policy:
    """The policy in ``path`` (TOML), or the built-in defaults when ``path`` is None."""
    if path is None:
        return Policy()
    return policy_from_dict(read_toml(path, PolicyError), origin=str(path))


def policy_from_dict(data: Mapping[str, Any], origin: str = "<dict>") -> Policy:
    problems: list[str] = []
    for key in sorted(set(data) - {"defaults", "namespaces"}):
        problems.append(f"{key}: unknown section (expected [defaults] or [namespaces.<name>])")
    defaults = _rules(data.get("defaults", {}), Rules(), "defaults", problems)
    namespaces: dict[str, Rules] = {}
    raw_namespaces = data.get("namespaces", {})
    if not isinstance(raw_namespaces, Mapping):
        problems.append("namespaces: must be a table of [namespaces.<name>] tables")
        raw_namespaces = {}
    for name, table in raw_namespaces.items():
        namespaces[name] = _rules(table, defaults, f"namespaces.{name}", problems)
    if problems:
        raise PolicyError(problems)
    return Policy(defaults, namespaces, origin)


def _rules(table: object, base: Rules, where: str, problems: list[str]) -> Rules:
    if not isinstance(table, Mapping):
        problems.append(f"{where}: must be a table")
        return base
    for key in sorted(set(table) - _KEYS):
        problems.append(f"{where}.{key}: unknown key (known: {', '.join(sorted(_KEYS))})")
    changes: dict[str, Any] = {}
    if "standing_strategy" in table:
        value = table["standing_strategy"]
        if value != "" and value not in FAULT_TIME_STRATEGIES:
            problems.append(f"{where}.standing_strategy: {value!r} must be one of "
                            f"{', '.join(FAULT_TIME_STRATEGIES)} or \"\" (hold)")
        else:
            changes["standing_strategy"] = value
    if "prefer" in table:
        value = table["prefer"]
        if (not isinstance(value, list) or not value or any(v not in PREFERABLE for v in value)
                or len(set(value)) != len(value)):
            problems.append(f"{where}.prefer: {value!r} must be a non-empty list of distinct "
                            f"strategies from {', '.join(PREFERABLE)}")
        else:
            changes["prefer"] = tuple(value)
    if "retry_fault_types" in table:
        value = table["retry_fault_types"]
        if (not isinstance(value, list)
                or any(isinstance(v, bool) or v not in (0, 2) for v in value)):
            problems.append(f"{where}.retry_fault_types: {value!r} must be a list of 0 (UCE) and/or "
                            "2 (HCCL); type 1 is never retried by ClusterD")
        else:
            changes["retry_fault_types"] = frozenset(value)
    if "rank_table" in table:
        value = table["rank_table"]
        if value not in RANK_TABLE_MODES:
            problems.append(f"{where}.rank_table: {value!r} must be one of {', '.join(RANK_TABLE_MODES)}")
        else:
            changes["rank_table"] = value
    if "on_malformed" in table:
        value = table["on_malformed"]
        if value not in MALFORMED_CHOICES:
            problems.append(f"{where}.on_malformed: {value!r} must be one of {', '.join(MALFORMED_CHOICES)}")
        else:
            changes["on_malformed"] = value
    return replace(base, **changes)
