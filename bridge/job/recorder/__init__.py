"""The recovery flight recorder: one face for the rest of the bridge.

The bridge is the one place that sees a recovery from both sides (ClusterD logs its side
on another machine, the controller in the training pods), so it keeps every cycle's
timeline on disk. The rest of the bridge knows the recorder only through what this
package exports; how it is built:

* ``cycles``  -- on the event loop, ``Recorder`` groups events into cycles (an O(1)
  append per event: recording never delays a report or a notify); ``RecorderWriter``,
  a thread of its own, writes them; ``Recording`` owns both for one run of the bridge.
* ``store``   -- the bounded SQLite store (WAL, so ``history`` reads a running bridge's).
* ``model``   -- phases, who was waited on, summaries: derived from the events, shared
  by ``history`` and ``otel``.
* ``config``  -- the ``[recorder]`` and ``[otel]`` tables, their defaults and ranges.
* ``history`` -- the ``tft-bridge history`` command (read-only).
* ``otel``    -- the optional OTLP trace export; imported only when ``[otel]`` is on,
  so nothing loads ``opentelemetry`` otherwise.
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
