"""Faults the platform knows of itself, merged into the agent's answer.

A platform often knows more than ClusterD: a node its own health checks condemned, a
rank it already drained. A *fault source* hands those to the agent when ClusterD asks
to confirm, and the agent merges them in with ClusterD's rule (type 1 sticky, so they
can add ranks or raise a 0/2 to 1, never lower ClusterD's 1). The default source knows
nothing.

A source is any object with a ``faults(namespace, name, confirmed)`` method returning a
``{rank: type}`` mapping, either ``async def`` (awaited on the agent's loop) or a plain
function (run in a worker thread). Load one with ``--fault-source module:attribute``;
the attribute is the source itself or a zero-argument factory for it. A source that
fails, times out or returns a bad map is counted and logged, and the answer goes out
with ClusterD's faults alone: ClusterD's 300 s wait is not the source's to spend.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from bridge.faults import merge_faults


@runtime_checkable
class FaultSource(Protocol):
    """Faults the platform knows of itself, asked once per confirm with a deadline (:func:`ask`)."""
    def faults(self, namespace: str, name: str, confirmed: Mapping[int, int]) -> Any:
        """``{rank: type}`` (types 0, 1, 2) for the PodGroup, or an awaitable of it."""


class NoFaults:
    """The default: the platform adds nothing to what ClusterD reports."""

    async def faults(self, namespace: str, name: str, confirmed: Mapping[int, int]) -> Mapping[int, int]:
        return {}


class StaticFaults:
    """Fixed faults per ``(namespace, name)``; for tests and simple integrations."""

    def __init__(self, table: Mapping[tuple[str, str], Mapping[int, int]] | None = None) -> None:
        self.table: dict[tuple[str, str], Mapping[int, int]] = dict(table or {})

    async def faults(self, namespace: str, name: str, confirmed: Mapping[int, int]) -> Mapping[int, int]:
        return self.table.get((namespace, name), {})


class FaultSourceError(Exception):
    """A fault source failed or timed out; the agent answers with ClusterD's faults only."""


async def ask(source: FaultSource, namespace: str, name: str, confirmed: Mapping[int, int],
              timeout: float) -> dict[int, int]:
    """Call ``source`` within ``timeout`` and validate its answer (``FaultSourceError``)."""
    method = source.faults
    try:
        if inspect.iscoroutinefunction(method):
            raw = await asyncio.wait_for(method(namespace, name, dict(confirmed)), timeout)
        else:
            raw = await asyncio.wait_for(asyncio.to_thread(method, namespace, name, dict(confirmed)), timeout)
            if inspect.isawaitable(raw):
                raw = await asyncio.wait_for(raw, timeout)
    except asyncio.TimeoutError:
        raise FaultSourceError(f"no answer within {timeout:g} s") from None
    except Exception as error:
        raise FaultSourceError(f"{type(error).__name__}: {error}") from error
    try:
        return merge_faults(raw if raw is not None else {})
    except (TypeError, ValueError) as error:
        raise FaultSourceError(f"bad fault map: {error}") from error


def load_fault_source(spec: str | None) -> FaultSource:
    """``None`` gives :class:`NoFaults`; ``"module:attribute"`` imports the source."""
    if not spec:
        return NoFaults()
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"fault source {spec!r} must be 'module:attribute'")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"fault source {spec!r}: {error}") from error
    if inspect.isclass(target) or (callable(target) and not hasattr(target, "faults")):
        try:
            source = target()
        except Exception as error:
            raise ValueError(f"fault source {spec!r}: the factory failed: {error}") from error
    else:
        source = target
    if not callable(getattr(source, "faults", None)):
        raise ValueError(f"fault source {spec!r} has no faults(namespace, name, confirmed) method")
    return source  # type: ignore[no-any-return]
