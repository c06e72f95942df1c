"""Process identity on Linux: a pid and its start time, since a pid alone is reused.

The start time is field 22 of ``/proc/<pid>/stat`` (clock ticks since boot); with the
boot id it names one process for good. A zombie counts as gone.
"""

from __future__ import annotations

from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may contain spaces or ')'.
    return text[text.rindex(")") + 2:].split()


def start_ticks(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def alive(pid: int, ticks: int | None) -> bool:
    """True while the process ``pid`` that started at ``ticks`` runs (not a zombie)."""
    if pid <= 0 or ticks is None:
        return False
    fields = _stat_fields(pid)
    return bool(fields) and len(fields) > 19 and int(fields[19]) == ticks and fields[0] != "Z"


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
