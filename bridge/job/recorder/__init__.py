"""The recovery flight recorder: one face for the rest of the bridge.

Every cycle's timeline, kept on disk in the job's state directory, read back by
``tft-bridge history`` and optionally exported as traces. The bridge uses only what this
package exports: ``cycles`` (``Recorder`` groups events into cycles on the event loop, an
O(1) append per event; ``RecorderWriter``, the thread ``tft-recorder``, writes them;
``Recording`` owns both), ``store`` (the bounded SQLite store, WAL), ``model`` (phases and
waits), ``history`` (the command) and ``otel`` (imported only when ``[otel]`` is on).
"""

from __future__ import annotations

from bridge.core.recorder_config import OtelConfig, RecorderConfig
from bridge.job.recorder.cycles import INLINE_FAULTS, ErrorLog, NullRecorder, Recorder, RecorderWriter, Recording

__all__ = [
    "INLINE_FAULTS",
    "ErrorLog",
    "NullRecorder",
    "OtelConfig",
    "Recorder",
    "RecorderConfig",
    "RecorderWriter",
    "Recording",
]
