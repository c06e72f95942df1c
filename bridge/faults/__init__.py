"""The fault-map codec: one API, two implementations.

``bridge.faults._c`` (compiled from ``ext/_faults_c.pyx``) when it was built, else
``bridge.faults._python``, the reference; ``BRIDGE_NO_EXTENSIONS=1`` forces the latter.
``IMPLEMENTATION`` ("c" or "python") says which runs, ``FALLBACK_REASON`` why the Python
twin does. Also the product's in-place merge by ClusterD's rule (type 1 sticky, else the
later type wins), ``merge_into``, and ``clean_faults`` (a controller fault map without
its bad entries: ClusterD empties the whole map for one bad rank). Pure: no metrics, no
logging; the caller counts what was bad. The simulations keep their own copy of the
rules, so a shared bug cannot hide.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import TYPE_CHECKING, Any, NamedTuple

from bridge.faults._python import FAULT_TYPES, MAX_RANK, LenientParse

NO_EXTENSIONS: bool = bool(os.environ.get("BRIDGE_NO_EXTENSIONS")) or sys.implementation.name != "cpython"

#: Why the pure-Python codec runs ("" when the compiled one does): ``tft-bridge --version``
#: prints it, because "python" alone does not tell an operator whether to reinstall.
FALLBACK_REASON: str = ""

if TYPE_CHECKING or NO_EXTENSIONS:
    from bridge.faults import _python as _impl

    if os.environ.get("BRIDGE_NO_EXTENSIONS"):
        FALLBACK_REASON = f"BRIDGE_NO_EXTENSIONS={os.environ['BRIDGE_NO_EXTENSIONS']!r} is set"
    elif not TYPE_CHECKING:
        FALLBACK_REASON = f"{sys.implementation.name} is not CPython: the compiled codec is CPython-only"
else:
    try:
        from bridge.faults import _c as _impl  # type: ignore[attr-defined, no-redef]
    except ImportError as error:  # pragma: no cover - installs without a compiler
        from bridge.faults import _python as _impl

        FALLBACK_REASON = f"the compiled codec bridge.faults._c failed to import: {error}"
        warnings.warn(
            "tft-bridge: the compiled fault codec is not installed (no compiler at install "
            "time?); using the pure-Python implementation",
            RuntimeWarning,
            stacklevel=2,
        )

IMPLEMENTATION: str = "c" if _impl.__name__.endswith("_c") else "python"

format_faults = _impl.format_faults
parse_faults = _impl.parse_faults
merge_faults = _impl.merge_faults
merge_faults_into = _impl.merge_faults_into
encode_fault_ranks = _impl.encode_fault_ranks
encode_process_fault_request = _impl.encode_process_fault_request
encode_stop_complete_request = _impl.encode_stop_complete_request
encode_recover_strategy_request = _impl.encode_recover_strategy_request
encode_recover_status_request = _impl.encode_recover_status_request
decode_signal_faults = _impl.decode_signal_faults


def merge_into(target: dict[int, int], faults: dict[int, int]) -> dict[int, int]:
    """ClusterD's merge of ``faults`` into ``target``, in place (the codec's
    ``merge_faults_into``, where the rule lives): a storm of one-rank reports must cost
    O(1) each, not a copy of everything merged so far (which made 10 000 callbacks
    quadratic). Returns ``target``."""
    return merge_faults_into(target, faults)


class CleanFaults(NamedTuple):
    """A fault map with its bad entries taken out (see ``clean_faults``)."""

    faults: dict[int, int]  # the valid entries, merged with ClusterD's rule
    bad: int  # entries left out (1 for a value that is not a mapping at all)
    error: str  # the codec's message for the first problem ("" when nothing was bad)


def clean_faults(raw: Any) -> CleanFaults:
    """The valid entries of ``raw`` (a controller's ``{rank: type}`` map). One bad entry
    must not poison the rest, nor reach ClusterD, whose rank parser empties the whole
    map for one bad rank; so bad entries are left out and counted, and the codec's
    message names the first. Never raises for bad input."""
    try:
        return CleanFaults(merge_faults(raw), 0, "")
    except (TypeError, ValueError) as error:
        message = str(error)
    if not hasattr(raw, "items"):
        return CleanFaults({}, 1, message)
    clean: dict[int, int] = {}
    bad = 0
    try:
        entries = list(raw.items())
    except Exception as error:  # noqa: BLE001 - a foreign mapping whose items() fails
        return CleanFaults({}, 1, f"{message}; items() failed: {error}")
    for key, value in entries:
        try:
            clean = merge_into(clean, merge_faults({key: value}))
        except (TypeError, ValueError):
            bad += 1
    return CleanFaults(clean, bad, message)

__all__ = [
    "FAULT_TYPES",
    "IMPLEMENTATION",
    "MAX_RANK",
    "FALLBACK_REASON",
    "CleanFaults",
    "LenientParse",
    "clean_faults",
    "decode_signal_faults",
    "encode_fault_ranks",
    "encode_process_fault_request",
    "encode_recover_status_request",
    "encode_recover_strategy_request",
    "encode_stop_complete_request",
    "format_faults",
    "merge_faults",
    "merge_faults_into",
    "merge_into",
    "parse_faults",
]
