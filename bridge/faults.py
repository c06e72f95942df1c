"""The fault-map codec: one API, two implementations.

``bridge._faults_c`` (compiled from ``ext/_faults_c.pyx``) is used when it was built;
``bridge._faults_py`` is the typed reference and the fallback. Set
``BRIDGE_NO_EXTENSIONS=1`` to force the Python twin; ``IMPLEMENTATION`` says which one
is active ("c" or "python") and is exported in the build-info metric.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import TYPE_CHECKING

from ._faults_py import FAULT_TYPES, MAX_RANK, LenientParse

NO_EXTENSIONS: bool = bool(os.environ.get("BRIDGE_NO_EXTENSIONS")) or sys.implementation.name != "cpython"

if TYPE_CHECKING or NO_EXTENSIONS:
    from . import _faults_py as _impl
else:
    try:
        from . import _faults_c as _impl  # type: ignore[attr-defined, no-redef]
    except ImportError:  # pragma: no cover - installs without a compiler
        from . import _faults_py as _impl

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
encode_fault_ranks = _impl.encode_fault_ranks
encode_process_fault_request = _impl.encode_process_fault_request
encode_stop_complete_request = _impl.encode_stop_complete_request
encode_recover_strategy_request = _impl.encode_recover_strategy_request
encode_recover_status_request = _impl.encode_recover_status_request
decode_signal_faults = _impl.decode_signal_faults

__all__ = [
    "FAULT_TYPES",
    "IMPLEMENTATION",
    "MAX_RANK",
    "LenientParse",
    "decode_signal_faults",
    "encode_fault_ranks",
    "encode_process_fault_request",
    "encode_recover_status_request",
    "encode_recover_strategy_request",
    "encode_stop_complete_request",
    "format_faults",
    "merge_faults",
    "parse_faults",
]
