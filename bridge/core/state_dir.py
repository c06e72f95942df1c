"""Where one job's bridge keeps what must outlive its process.

``state_directory`` is the one rule for the orphaned-job marker
(``bridge.job.session.orphan``) and the flight recorder's store (``bridge.job.recorder``),
so ``tft-bridge history`` finds the store where the bridge wrote it: the configured
directory, else the unit's ``$STATE_DIRECTORY``, else ``/var/lib/tft-bridge/<job>``, the
job id made one path component (``safe_component``).
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
