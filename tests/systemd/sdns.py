"""A real systemd 252 booted as PID 1 of a namespace of its own (``../shared/systemd``,
its README), with the shipped units installed verbatim, for the systemd tier.

``Systemd.boot`` starts one instance with the checkout bound at its own path and a venv
made from the distribution's ``/usr/bin/python3.11`` at ``/opt/tft-bridge/venv`` (where
the units' ``ExecStart=`` looks: outside ``/tmp`` and ``/root``, which the units'
``PrivateTmp=``/``ProtectHome=`` hide), runs commands inside (``run``), reads units
(``show``) and, at the end, saves the journal beside the test's files and stops it. The
network is the host's: the stand-in API server and the simulated ClusterD run in the
test process's host and are reached on 127.0.0.1.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: ../shared/systemd beside the checkout (CI's clean clone), or beside the directory of
#: worktrees that holds it; TFT_BRIDGE_SYSTEMD_NS names the script elsewhere.
SCRIPT = next((path for path in (Path(os.environ.get("TFT_BRIDGE_SYSTEMD_NS", "/nonexistent")),
                                 ROOT.parent / "shared" / "systemd" / "systemd-ns.sh",
                                 ROOT.parent.parent / "shared" / "systemd" / "systemd-ns.sh") if path.exists()),
              ROOT.parent / "shared" / "systemd" / "systemd-ns.sh")
SYSTEM_PYTHON = Path("/usr/bin/python3.11")
VENV = ROOT / ".venv-systemd"
OPT_VENV = "/opt/tft-bridge/venv"
UNITS = ("tft-bridge@.service", "tft-bridge-node.service")
COMMAND_TIMEOUT = 60.0


def missing() -> str:
    """Why the tier cannot run here ("" = it can)."""
    if os.environ.get("TFT_BRIDGE_SYSTEMD") == "separate":
        return "run as a stage of its own (TFT_BRIDGE_SYSTEMD=separate)"
    if os.geteuid() != 0:
        return "not root"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"no {tool}"
    if not Path("/usr/bin/systemd").exists():
        return "no /usr/bin/systemd"
    if not SCRIPT.exists():
        return f"no {SCRIPT}"
    if not SYSTEM_PYTHON.exists():
        return f"no {SYSTEM_PYTHON}"
    if not list((ROOT / "bridge" / "_proto").glob("*_pb2.py")):
        return "the checkout is not built (pip install -e . generates bridge/_proto)"
    return ""


def ensure_venv() -> Path:
    """``.venv-systemd`` in the checkout: the project's dependencies installed in a venv of
    ``/usr/bin/python3.11``, the checkout on its path (as an editable install has it) and
    the ``tft-bridge`` script. Nothing is built: the checkout's generated code and codec
    are used as they are (the same CPython ABI), so this never writes the tree."""
    script = VENV / "bin" / "tft-bridge"
    with open(ROOT / ".venv-systemd.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if script.exists():
            return VENV
        shutil.rmtree(VENV, ignore_errors=True)
        subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", str(VENV)], check=True, timeout=120)
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        requirements = [*project["dependencies"], *project["optional-dependencies"]["node"]]
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", *requirements], check=True, timeout=600)
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        site = next((VENV / "lib").glob("python3.*/site-packages"), None) or VENV / "lib" / f"python{version}"
        (site / "tft-bridge-checkout.pth").write_text(f"{ROOT}\n")
        script.write_text(f"#!{VENV}/bin/python3.11\nimport sys\nfrom bridge.cli import main\n"
                          "sys.exit(main())\n")
        script.chmod(0o755)
    return VENV


class Systemd:
    """One booted instance; every method runs inside it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.pid = 0

    def boot(self, venv: Path) -> Systemd:
        env = {**os.environ, "SDNS_BIND": str(ROOT)}
        result = subprocess.run(["bash", str(SCRIPT), "start", str(self.directory)], env=env, capture_output=True,
                                text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"systemd-ns start failed: {result.stderr.strip()[-2000:]}")
        self.pid = int(result.stdout.split()[-1])
        self.run("mkdir", "-p", "/opt/tft-bridge", "/etc/tft-bridge")
        self.run("ln", "-s", str(venv), OPT_VENV)
        for unit in UNITS:  # verbatim
            self.run("cp", str(ROOT / "systemd" / unit), f"/etc/systemd/system/{unit}")
        self.run("systemctl", "daemon-reload")
        return self

    def run(self, *argv: str, check: bool = True, timeout: float = COMMAND_TIMEOUT,
            input: str | None = None) -> subprocess.CompletedProcess[str]:  # noqa: A002 - subprocess's name
        result = subprocess.run(["bash", str(SCRIPT), "exec", str(self.directory), "--", *argv], capture_output=True,
                                text=True, timeout=timeout, input=input)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {result.returncode}: {result.stderr.strip()[-2000:]}")
        return result

    def write(self, path: str, text: str) -> None:
        self.run("sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1"', "sh", path, input=text)

    def read(self, path: str) -> str:
        result = self.run("cat", path, check=False)
        return result.stdout if result.returncode == 0 else ""

    def drop_in(self, unit: str, name: str, text: str) -> None:
        self.write(f"/etc/systemd/system/{unit}.d/{name}.conf", text)
        self.run("systemctl", "daemon-reload")

    def show(self, unit: str, *properties: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, *(f"--property={p}" for p in properties)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str | None = None) -> str:
        return self.run("journalctl", "--no-pager", "-o", "short-monotonic", *(["-u", unit] if unit else [])).stdout

    def stop(self, save: Path | None) -> None:
        if self.pid and save is not None:
            try:
                save.write_text(self.journal())
            except Exception as error:  # the journal is a help for a failure, not the result
                save.write_text(f"journal not saved: {error}\n")
        subprocess.run(["bash", str(SCRIPT), "stop", str(self.directory)], capture_output=True, timeout=120)
