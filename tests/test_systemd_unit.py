"""The systemd unit: ``systemd-analyze verify`` must be silent, the hardening score must
stay low, and the keys the daemon's contract depends on must be present.

``systemd-analyze verify`` exits 0 even with "Unknown key" warnings, so any stderr output
is a failure. It exits 1 when the ``ExecStart=`` binary is missing, which is why the
unit is checked with ``ExecStart=`` rewritten to this interpreter (``python -m
bridge.cli``). PID 1 does not have to be systemd: both commands work offline.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.core.config import ClusterDConfig, ControllerConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "tft-bridge@.service"
EXAMPLE = ROOT / "systemd" / "example-job.toml"
INSTANCE = "tft-bridge@job1.service"

# Measured with systemd 252: 1.1 ("OK"). The unit fails this test if it gets laxer than
# this. systemd-analyze takes the threshold times ten.
SECURITY_THRESHOLD = 13

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")

TRUE_VALUES = {"1", "yes", "y", "true", "t", "on"}


# --------------------------------------------------------------------------- helpers

def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """Sections to (key, value) pairs in order. Keys can repeat, so configparser does
    not fit. Comments and blank lines are skipped, and backslash continuations are
    joined."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"assignment outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not an assignment: {line!r}"
        current.append((key.strip(), value.strip()))
    return sections


def values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def last(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str:
    found = values(unit, section, key)
    assert found, f"[{section}] {key}= is missing"
    return found[-1]


def seconds(value: str) -> float:
    """A systemd time span (``90s``, ``1min 30s``, ``2m``, a bare number of seconds)."""
    units = {"": 1, "s": 1, "sec": 1, "second": 1, "seconds": 1, "ms": 1e-3, "msec": 1e-3,
             "m": 60, "min": 60, "minute": 60, "minutes": 60, "h": 3600, "hr": 3600, "hour": 3600, "hours": 3600}
    total = 0.0
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value.strip())
    assert parts and "".join(n + u for n, u in parts) == re.sub(r"\s+", "", value), f"unparsed time span {value!r}"
    for number, unit in parts:
        total += float(number) * units[unit]
    return total


def systemd_quote(word: str) -> str:
    """One ExecStart= word: '%' escaped as '%%', and double-quoted if it holds spaces."""
    word = word.replace("%", "%%")
    if re.search(r"[\s\"'\\]", word):
        return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def installed_copy(tmp_path: Path, text: str | None = None, executable: str | None = None) -> Path:
    """The unit as ``tft-bridge@job1.service`` in ``tmp_path``, with ExecStart= running
    ``executable`` (default: this interpreter with ``-m bridge.cli``) and the same
    arguments."""
    text = UNIT.read_text() if text is None else text
    command = executable or f"{systemd_quote(sys.executable)} -m bridge.cli"
    rewritten, count = re.subn(r"(?m)^ExecStart=\S+/tft-bridge(?= )", lambda m: f"ExecStart={command}", text)
    assert count == 1, "expected exactly one ExecStart=.../tft-bridge line"
    path = tmp_path / INSTANCE
    path.write_text(rewritten)
    return path


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    return subprocess.run([SYSTEMD_ANALYZE, *args], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": "",
                               "LC_ALL": "C.UTF-8"})


def verify_problems(path: Path) -> str:
    """Empty when ``systemd-analyze verify`` is clean: rc 0 AND nothing on stderr."""
    result = analyze("verify", "--man=no", str(path))
    if result.returncode == 0 and not result.stderr.strip():
        return ""
    return f"rc={result.returncode}\nstderr:\n{result.stderr}\nstdout:\n{result.stdout}"


# --------------------------------------------------------------------------- systemd-analyze

@needs_systemd_analyze
def test_verify_is_clean(tmp_path: Path) -> None:
    path = installed_copy(tmp_path)
    assert sys.executable.replace("%", "%%") in path.read_text()
    problems = verify_problems(path)
    assert not problems, f"systemd-analyze verify is not clean:\n{problems}"


@needs_systemd_analyze
def test_verify_catches_a_missing_binary(tmp_path: Path) -> None:
    """The reason ExecStart= is rewritten. This also shows the check can fail at all."""
    path = installed_copy(tmp_path, executable=str(tmp_path / "no-such-dir" / "tft-bridge"))
    assert verify_problems(path)


@needs_systemd_analyze
def test_verify_catches_an_unknown_key_warning(tmp_path: Path) -> None:
    """StartLimitIntervalSec= in [Service] gives rc 0 plus "Unknown key" on stderr.
    The check must treat that as a failure. (StartLimitBurst= is still accepted there
    for compatibility.)"""
    text = UNIT.read_text().replace("[Service]\n", "[Service]\nStartLimitIntervalSec=300\n", 1)
    path = installed_copy(tmp_path, text)
    result = analyze("verify", "--man=no", str(path))
    assert result.returncode == 0 and "Unknown key 'StartLimitIntervalSec'" in result.stderr, result.stderr
    assert verify_problems(path)


@needs_systemd_analyze
def test_security_exposure_stays_low(tmp_path: Path) -> None:
    path = installed_copy(tmp_path)
    result = analyze("security", "--offline=true", f"--threshold={SECURITY_THRESHOLD}", str(path))
    score = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?) (\w+)", result.stdout)
    assert score, f"no overall score in:\n{result.stdout}\n{result.stderr}"
    assert result.returncode == 0, (
        f"exposure {score.group(1)} {score.group(2)} is above the threshold {SECURITY_THRESHOLD / 10}:\n"
        + "\n".join(line for line in result.stdout.splitlines() if line.startswith("✗"))
    )
    assert float(score.group(1)) * 10 <= SECURITY_THRESHOLD


# --------------------------------------------------------------------------- the unit's contract, in Python

@pytest.fixture(scope="module")
def unit() -> dict[str, list[tuple[str, str]]]:
    return parse_unit(UNIT.read_text())


def test_notify_and_watchdog(unit: dict[str, list[tuple[str, str]]]) -> None:
    assert last(unit, "Service", "Type") == "notify"
    assert last(unit, "Service", "NotifyAccess") == "main"
    watchdog = seconds(last(unit, "Service", "WatchdogSec"))
    # The daemon pings every min(1 s, WATCHDOG_USEC/2). Keep slack for a busy node.
    assert 10 <= watchdog <= 120


def test_restart_policy_matches_the_exit_codes(unit: dict[str, list[tuple[str, str]]]) -> None:
    from bridge.job.daemon import EXIT_CONFIG, EXIT_CONTROLLER_ENDED, EXIT_RESCHEDULED

    assert last(unit, "Service", "Restart") == "on-failure"
    forced = " ".join(values(unit, "Service", "RestartForceExitStatus")).split()
    prevented = " ".join(values(unit, "Service", "RestartPreventExitStatus")).split()
    assert str(EXIT_RESCHEDULED) == "75" and "75" in forced
    # A controller that ended cannot be restarted in place: a fresh bridge must take the
    # job's next incarnation, even if a drop-in changes Restart=.
    assert str(EXIT_CONTROLLER_ENDED) == "76" and "76" in forced and "76" not in prevented
    assert str(EXIT_CONFIG) == "2" and "2" in prevented
    for key in ("StartLimitIntervalSec", "StartLimitBurst"):
        assert values(unit, "Unit", key), f"{key}= belongs in [Unit]"
        assert not values(unit, "Service", key), f"{key}= in [Service] is ignored by systemd"


def test_memory_deny_write_execute_is_off(unit: dict[str, list[tuple[str, str]]]) -> None:
    """MDWE breaks the libffi closures the native controller calls back through."""
    for value in values(unit, "Service", "MemoryDenyWriteExecute"):
        assert value.lower() not in TRUE_VALUES


def test_address_families_allow_the_controller(unit: dict[str, list[tuple[str, str]]]) -> None:
    families = set(" ".join(values(unit, "Service", "RestrictAddressFamilies")).split())
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= families
    assert not any(f.startswith("~") for f in families)
    assert not values(unit, "Service", "PrivateNetwork")


def test_command_environment_and_identity(unit: dict[str, list[tuple[str, str]]]) -> None:
    exec_start = last(unit, "Service", "ExecStart")
    assert exec_start.endswith("/tft-bridge run --config /etc/tft-bridge/%i.toml")
    assert "PYTHONUNBUFFERED=1" in values(unit, "Service", "Environment")
    assert "-/etc/tft-bridge/%i.env" in values(unit, "Service", "EnvironmentFile")
    assert last(unit, "Service", "SyslogIdentifier") == "tft-bridge-%i"
    assert last(unit, "Service", "KillMode") in ("mixed", "control-group")
    # LoadCredential= only in comments: a missing key file would make every start fail.
    assert not values(unit, "Service", "LoadCredential")


def test_timeouts_cover_start_up_and_stop(unit: dict[str, list[tuple[str, str]]]) -> None:
    example = load_config(EXAMPLE, env={})
    startup_wait = max(ClusterDConfig().startup_wait, example.clusterd.startup_wait)
    destroy = max(ControllerConfig().destroy_timeout, example.controller.destroy_timeout)
    # Init wait, then importing and starting the controller.
    assert seconds(last(unit, "Service", "TimeoutStartSec")) >= startup_wait + 30
    # Up to 5 s of drain, the bounded destroy, then task and metrics shutdown.
    assert seconds(last(unit, "Service", "TimeoutStopSec")) >= 5 + destroy + 10
    # The bridge's own bound on a whole stop (it exits past it, whatever the controller
    # does) ends before systemd's SIGKILL, which would skip the log flush.
    from bridge.job.daemon import stop_budget

    assert stop_budget(load_config(EXAMPLE, env={})) + 5 <= seconds(last(unit, "Service", "TimeoutStopSec"))
    # The default destroy bound covers the real destroy (1-5 s, about 5 s typical) with room.
    assert ControllerConfig().destroy_timeout >= 3 * 5


def test_parse_unit_helpers() -> None:
    parsed = parse_unit("[A]\n# c\nX=1\nX=2 \\\n  3\n[B]\nY = a=b\n")
    assert parsed == {"A": [("X", "1"), ("X", "2 3")], "B": [("Y", "a=b")]}
    assert seconds("90s") == 90 and seconds("1min 30s") == 90 and seconds("30") == 30
    assert systemd_quote("/a b/%p") == '"/a b/%%p"'


def syscall_group(name: str, seen: set[str] | None = None) -> set[str]:
    """The system calls of a systemd filter group, nested groups expanded."""
    seen = set() if seen is None else seen
    if not name.startswith("@"):
        return {name}
    if name in seen:
        return set()
    seen.add(name)
    out = analyze("syscall-filter", name).stdout.splitlines()
    calls: set[str] = set()
    for line in out[1:]:  # the first line repeats the group's name
        entry = line.strip()
        if entry and not entry.startswith("#"):
            calls |= syscall_group(entry, seen)
    return calls


@needs_systemd_analyze
def test_the_report_path_threads_may_set_their_own_policy_and_cpus(unit: dict[str, list[tuple[str, str]]]) -> None:
    """The report path's threads call sched_setscheduler (bridge/job/sched/realtime.py, the
    wire's SCHED_BATCH), and the controller's callback thread and the wire's thread
    sched_setaffinity (bridge/job/sched/affinity.py); @resources holds both calls, and the unit
    denies @resources. Applied in systemd's order (the first line sets allow-list mode,
    later lines add or remove), both must end up allowed, and nothing else of @resources
    with them."""
    lines = values(unit, "Service", "SystemCallFilter")
    assert lines and not lines[0].startswith("~"), "an allow-list filter is expected"
    allowed: set[str] = set()
    for line in lines:
        deny = line.startswith("~")
        names = set().union(*(syscall_group(name) for name in line.lstrip("~").split()))
        allowed = allowed - names if deny else allowed | names
    assert {"sched_setscheduler", "sched_setaffinity"} <= allowed
    assert not (syscall_group("@resources") - {"sched_setscheduler", "sched_setaffinity"}) & allowed
    assert "setrlimit" not in allowed
