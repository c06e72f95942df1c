"""``tft-bridge``: run the daemon, check a config, run the demo, work with fault strings,
run the simulated ClusterD, run the AI-platform policy agent, run the node service.

Exit codes: 0 ok; 1 start-up failed; 2 bad configuration or bad input; 75 ClusterD sent
killMaster (the job is being rescheduled; the systemd unit restarts the bridge for it);
76 the controller ended on its own (EXIT/FINAL; the unit restarts the bridge with a fresh
controller). ``report-fault``: 0 handed over; 2 bad input; 3 refused (no bridge runs for the
job, it serves another job, or its controller is not running).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from bridge import faults as codec
from bridge.core.config import BridgeConfig, ConfigError, config_warnings, load_config
from bridge.core.interrupts import capture_signals
from bridge.core.logs import setup_logging
from bridge.job.recorder.history import add_history_parser
from bridge.node import add_node_parser
from bridge.platform import add_platform_parser

log = logging.getLogger("tft_bridge")


# --------------------------------------------------------------------------- run / check-config

def load_or_report(path: str) -> BridgeConfig | None:
    """The configuration, or None after printing every problem (the caller exits 2)."""
    try:
        return load_config(path)
    except ConfigError as error:
        print(error, file=sys.stderr)
        return None


def cmd_run(args: argparse.Namespace) -> int:
    """``tft-bridge run``: the per-job bridge in this process until it stops; its exit code."""
    config = load_or_report(args.config)
    if config is None:
        return 2
    setup_logging(args.log_level or config.log_level)
    from bridge.job.daemon import EXIT_FAILED, Bridge, arm_exit_deadline, exit_now, stop_budget

    bridges: list[Bridge] = []

    def stopping() -> None:
        # The whole stop is bounded whatever the controller does (bridge/job/daemon.py).
        arm_exit_deadline(stop_budget(config), lambda: bridges[0].exit_code)

    async def main() -> int:
        bridge = Bridge(config, on_stopping=stopping)
        bridges.append(bridge)
        with capture_signals(bridge.request_stop):
            return await bridge.run()

    # Never returns: the process ends with os._exit once the bounded stop is over, so the
    # controller's atexit destroy cannot hang it (daemon.exit_now).
    code = EXIT_FAILED
    try:
        code = asyncio.run(main())
    except BaseException:  # noqa: BLE001 - a normal exit after this could hang in the controller's atexit
        log.exception("the bridge failed outside its own stop")
    exit_now(code)
    return code  # not reached


def cmd_ranktable(args: argparse.Namespace) -> int:
    """The rank table subscription alone (the [ranktable] section of a job config)."""
    config = load_or_report(args.config)
    if config is None:
        return 2
    if not config.ranktable.job_id or not config.ranktable.path:
        print("invalid configuration:\n  ranktable: needs ranktable.job_id and ranktable.path", file=sys.stderr)
        return 2
    setup_logging(args.log_level or config.log_level)
    from bridge.job.metrics import BridgeMetrics
    from bridge.job.session.rank_table import RankTableSubscriber

    async def main() -> int:
        subscriber = RankTableSubscriber(config.ranktable, config.clusterd, BridgeMetrics(),
                                         hook_timeout=config.hooks.timeout)
        with capture_signals(subscriber.stop):
            await subscriber.run()
        return 0

    return asyncio.run(main())


def cmd_check_config(args: argparse.Namespace) -> int:
    """``tft-bridge check-config``: the effective configuration and its warnings; 2 when it is invalid."""
    config = load_or_report(args.file)
    if config is None:
        return 2
    for line in config_warnings(config):  # legal but doomed with the real peers: said, not refused
        print(f"warning: {line}", file=sys.stderr)
    print(json.dumps(config.as_dict(), indent=2, sort_keys=False))
    return 0


# --------------------------------------------------------------------------- faults

def cmd_faults(args: argparse.Namespace) -> int:
    """``tft-bridge faults``: parse, merge or format fault strings; 2 for bad input."""
    try:
        if args.faults_command == "merge":
            merged = codec.merge_faults(*(codec.parse_faults(text) for text in args.texts))
            print(codec.format_faults(merged))
        elif args.faults_command == "format":
            data = json.loads(args.json)
            if not isinstance(data, dict):
                raise ValueError("expected a JSON object of rank to fault type")
            print(codec.format_faults({_json_int(k, "rank"): _json_int(v, "type") for k, v in data.items()}))
        elif args.lenient:
            parsed = codec.parse_faults(args.text, strict=False)
            print(codec.format_faults(parsed.faults))
            for element in parsed.dropped:
                print(f"dropped by ClusterD (bad format): {element!r}", file=sys.stderr)
            for element in parsed.rejected:
                print(f"kept by ClusterD but not a valid fault: {element!r}", file=sys.stderr)
            if parsed.poisoned:
                print("POISONED: a rank is not an integer; ClusterD would run the cycle with no ranks at all",
                      file=sys.stderr)
                return 1
        else:
            print(codec.format_faults(codec.parse_faults(args.text)))
    except (ValueError, TypeError) as error:
        print(f"tft-bridge faults: {error}", file=sys.stderr)
        return 2
    return 0


def _json_int(value: object, what: str) -> int:
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"{what} {value!r} is not a decimal integer")


# --------------------------------------------------------------------------- report-fault

EXIT_REFUSED = 3


def cmd_report_fault(args: argparse.Namespace) -> int:
    """Hand faults to the job's running bridge (bridge/job/reports/operator_faults.py)."""
    from bridge.core.config import ConfigError
    from bridge.job.reports.operator_faults import SOCKET_NAME, RequestError, parse_faults, request, target

    try:
        job_id, directories, world_size = target(args.config, args.job_id)
        if args.state_dir:
            directories = [Path(args.state_dir)]
        parse_faults(args.faults, world_size)  # the bridge checks again; a typo is said here at once
    except (RequestError, ValueError, ConfigError) as error:
        print(f"tft-bridge report-fault: {error}", file=sys.stderr)
        return 2
    for directory in directories:
        path = directory / SOCKET_NAME
        if not path.exists():
            continue
        try:
            answer = request(path, job_id, args.faults)
        except OSError as error:
            print(f"tft-bridge report-fault: no bridge answers on {path} ({error.strerror or error}): is the "
                  f"bridge for job {job_id!r} running, and may this user use its state directory?", file=sys.stderr)
            return EXIT_REFUSED
        if answer.get("ok"):
            live = "" if answer.get("live") else " (queued: ClusterD's subscription is not live yet)"
            print(f"handed to the bridge of job {job_id}: {answer.get('faults')}{live}")
            return 0
        print(f"tft-bridge report-fault: refused by the bridge: {answer.get('error')}", file=sys.stderr)
        return 2 if answer.get("reason") == "bad_input" else EXIT_REFUSED
    where = " or ".join(str(d / SOCKET_NAME) for d in directories)
    print(f"tft-bridge report-fault: no bridge is running for job {job_id!r} (no socket at {where})",
          file=sys.stderr)
    return EXIT_REFUSED


# --------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    """Every ``tft-bridge`` subcommand, each with its ``func``."""
    parser = argparse.ArgumentParser(prog="tft-bridge", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=VersionReport, help="print the version, the codec in use, the Python, "
                        "the platform and whether mindio_ttp imports (for a bug report), and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="run the bridge for one job (the systemd unit's command)")
    run.add_argument("--config", required=True, help="the job's TOML configuration file")
    run.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="overrides log_level")
    run.set_defaults(func=cmd_run)

    ranktable = commands.add_parser("ranktable", help="only subscribe to the rank table and keep its file current")
    ranktable.add_argument("--config", required=True, help="a job config with a [ranktable] section")
    ranktable.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    ranktable.set_defaults(func=cmd_ranktable)

    check = commands.add_parser("check-config", help="validate a config file and print the effective configuration")
    check.add_argument("file")
    check.set_defaults(func=cmd_check_config)

    demo = commands.add_parser("demo", help="a simulated ClusterD, the stub controller and the bridge: one real recovery")
    demo.add_argument("--scenario", default="retry", choices=["retry", "recover", "dump", "exit", "retry-fails"])
    demo.add_argument("--hold", type=float, default=0.0, metavar="SECONDS",
                      help="keep running this long after the scenario so the metrics can be scraped")
    demo.add_argument("--metrics-port", type=int, default=0, help="metrics port (default: any free port)")
    demo.add_argument("--release", default="master", choices=["master", "7.3", "7.0"],
                      help="the ClusterD release the simulated ClusterD plays (docs/releases.md)")
    demo.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    demo.set_defaults(func=_lazy("sim.demo", "cmd_demo"))

    sim = commands.add_parser("sim-clusterd", help="run the simulated ClusterD on its own, logging every RPC and signal")
    # The simulations are found by name, never imported by the product (bridge/sim/cli.py).
    importlib.import_module("bridge.sim.cli").add_arguments(sim)
    sim.set_defaults(func=_lazy("sim.cli", "cmd_sim_clusterd"))

    faults = commands.add_parser("faults", help="format, parse and merge \"rank:type\" fault strings")
    fsub = faults.add_subparsers(dest="faults_command", required=True, metavar="ACTION")
    parse = fsub.add_parser("parse", help="check a fault string; print its canonical form")
    parse.add_argument("text")
    parse.add_argument("--lenient", action="store_true", help="show what ClusterD's own parser makes of it")
    merge = fsub.add_parser("merge", help="merge fault strings with ClusterD's rule (type 1 sticky)")
    merge.add_argument("texts", nargs="+")
    fmt = fsub.add_parser("format", help='canonical string of a JSON map, e.g. \'{"4": 1, "1": 0}\'')
    fmt.add_argument("json")
    faults.set_defaults(func=cmd_faults)
    report = commands.add_parser("report-fault", help="hand faults (RANK:TYPE,...) to the job's running bridge, "
                                                      "which reports them to ClusterD as the controller's own")
    report.add_argument("--config", required=True, help="the job's TOML configuration file")
    report.add_argument("--job-id", default="", help="the job id, when the config takes it from the unit's "
                                                     "environment (MINDX_TASK_ID)")
    report.add_argument("--state-dir", default="", help="the bridge's state directory (default: from the config, "
                                                        "else /var/lib/tft-bridge/<config name or job id>)")
    report.add_argument("faults", metavar="RANK:TYPE[,...]",
                        help="fault ranks and types: 0 UCE, 1 other (a dead process), 2 HCCL; e.g. 5:1,6:1")
    report.set_defaults(func=cmd_report_fault)
    add_history_parser(commands)
    add_platform_parser(commands)
    add_node_parser(commands)
    return parser


class VersionReport(argparse.Action):
    """``--version``: the full report of bridge/job/version_report.py, not only the number."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:  # noqa: A002 - argparse's name
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        from bridge.job.version_report import report

        print(report())
        parser.exit()


def _lazy(module: str, name: str):  # type: ignore[no-untyped-def]
    """Import heavy subcommands (the simulations) only when they run."""

    def call(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(f"bridge.{module}"), name)(args)

    return call


def main(argv: Sequence[str] | None = None) -> int:
    """The ``tft-bridge`` entry point: the subcommand's exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
