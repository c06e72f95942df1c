"""Where one job's bridge keeps what must outlive its process.

Two things do: the orphaned-job marker (``orphan.py``: a controller that did not stop
cleanly leaves ranks no new controller accepts) and the flight recorder's store
(``recorder.py``: an on-call engineer reads a recovery back after the bridge restarted).
Both belong in the directory systemd keeps across restarts for the unit
(``StateDirectory=tft-bridge/%i``, passed as ``$STATE_DIRECTORY``), so both resolve it by
this one rule, and ``tft-bridge history`` finds the store where the bridge wrote it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

#: The unit's StateDirectory= root; the fallback for a bridge run outside systemd.
STATE_ROOT = Path("/var/lib/tft-bridge")


def safe_component(name: str) -> str:
    """A job id as one path component (ids are UIDs, but a '/' must never escape the root)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


def state_directory(configured: str, job_id: str, env: Mapping[str, str] | None = None) -> Path:
    """``configured``, else the unit's ``$STATE_DIRECTORY`` (the first, if systemd passed
    several), else /var/lib/tft-bridge/<job_id>."""
    if configured:
        return Path(configured)
    env = os.environ if env is None else env
    given = env.get("STATE_DIRECTORY", "").split(":")[0]
    if given:
        return Path(given)
    return STATE_ROOT / safe_component(job_id)
