"""``tft-bridge platform``: run the platform policy agent (or check its policy file).

Exit codes as for the rest of ``tft-bridge``: 0 ok (stopped by SIGTERM/SIGINT); 1
start-up failed (no Kubernetes client or configuration, metrics port taken); 2 bad
policy file or bad option. SIGHUP reloads the policy file (a bad file is logged and
the running policy kept).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from typing import Any

from bridge.core.interrupts import capture_signals
from bridge.core.logs import setup_logging

log = logging.getLogger("tft_bridge.platform")

DEFAULT_METRICS_PORT = 9466
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def add_platform_parser(subparsers: Any) -> None:
    """Declare ``platform`` on the ``tft-bridge`` subcommand parser."""
    parser = subparsers.add_parser(
        "platform",
        help="run the AI-platform policy agent: answers ClusterD's PodGroup annotations (platform mode)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--policy", metavar="FILE", help="TOML policy file (default: built-in defaults; "
                        "see contrib/platform-policy.example.toml)")
    parser.add_argument("--check", action="store_true", help="validate the policy, print it as JSON and exit")
    api = parser.add_argument_group("Kubernetes API")
    api.add_argument("--kubeconfig", metavar="PATH", help="kubeconfig file (default: the in-cluster service account)")
    api.add_argument("--context", help="kubeconfig context (default: the current one)")
    api.add_argument("--server", metavar="URL",
                     help="API server URL used without credentials, e.g. http://127.0.0.1:8001 from kubectl proxy")
    api.add_argument("--namespace", "-n", help="watch PodGroups of one namespace (default: all namespaces)")
    api.add_argument("--selector", "-l", help="label selector for the PodGroups to manage, e.g. platform=ours")
    api.add_argument("--request-timeout", type=float, default=10.0, metavar="SECONDS",
                     help="timeout of every API request (default: 10)")
    agent = parser.add_argument_group("agent")
    agent.add_argument("--fault-source", metavar="MODULE:ATTR",
                       help="faults the platform knows, merged into every answer (default: none)")
    agent.add_argument("--resync", type=float, default=30.0, metavar="SECONDS",
                       help="look at every PodGroup again this often (default: 30)")
    agent.add_argument("--stale-after", type=float, default=1800.0, metavar="SECONDS",
                       help="clear a cycle whose end was never seen after this long (default: 1800)")
    metrics = parser.add_argument_group("metrics")
    metrics.add_argument("--metrics-address", default="127.0.0.1",
                         help="address of the Prometheus endpoint (default: 127.0.0.1)")
    metrics.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                         help=f"port of the Prometheus endpoint, 0 for any free port (default: {DEFAULT_METRICS_PORT})")
    metrics.add_argument("--no-metrics", action="store_true", help="no Prometheus endpoint")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)
    parser.set_defaults(func=cmd_platform)


def cmd_platform(args: argparse.Namespace) -> int:
    from bridge.platform.policy import PolicyError, load_policy

    try:
        policy = load_policy(args.policy)
    except PolicyError as error:
        print(error, file=sys.stderr)
        return 2
    if args.check:
        print(json.dumps(policy.as_dict(), indent=2))
        return 0
    for option in ("resync", "stale_after", "request_timeout"):
        if not getattr(args, option) > 0:
            print(f"--{option.replace('_', '-')} must be positive", file=sys.stderr)
            return 2

    from bridge.platform.sources import load_fault_source

    try:
        source = load_fault_source(args.fault_source)
    except ValueError as error:
        print(f"tft-bridge platform: {error}", file=sys.stderr)
        return 2
    from bridge.core.kube import MissingClient, api_client
    from bridge.platform.podgroup_api import PodGroupApi

    try:
        client = api_client(args.kubeconfig, args.context, args.server)
    except MissingClient as error:
        print(f"tft-bridge platform: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # kubeconfig or in-cluster configuration problems
        print(f"tft-bridge platform: no Kubernetes configuration: {error}", file=sys.stderr)
        return 1
    from bridge.platform.agent import AgentSettings, PlatformAgent
    from bridge.core.metrics_http import MetricsServer
    from bridge.platform.metrics import PlatformMetrics

    setup_logging(args.log_level)
    metrics = PlatformMetrics()
    server: MetricsServer | None = None
    if not args.no_metrics:
        try:
            server = MetricsServer(metrics, args.metrics_address, args.metrics_port)
            server.start()
        except OSError as error:
            print(f"tft-bridge platform: metrics endpoint {args.metrics_address}:{args.metrics_port}: {error}",
                  file=sys.stderr)
            return 1
        log.info("metrics on http://%s:%d/metrics", args.metrics_address, server.port)
    api = PodGroupApi(client, request_timeout=args.request_timeout, connect_timeout=min(5.0, args.request_timeout))
    settings = AgentSettings(namespace=args.namespace or None, selector=args.selector or None,
                             resync_seconds=args.resync, stale_after=args.stale_after)
    agent = PlatformAgent(api, policy, settings, metrics, source)
    try:
        return asyncio.run(_serve(agent, args.policy))
    finally:
        api.close()
        if server is not None:
            server.stop()


async def _serve(agent: Any, policy_path: str | None) -> int:
    from bridge.platform.policy import PolicyError, load_policy

    def on_reload() -> None:
        if policy_path is None:
            log.info("SIGHUP: no policy file to reload")
            return
        try:
            policy = load_policy(policy_path)
        except PolicyError as error:
            agent.metrics.policy_reloads.labels("rejected").inc()
            log.error("SIGHUP: keeping the running policy: %s", error)
            return
        agent.metrics.policy_reloads.labels("ok").inc()
        agent.set_policy(policy)
        log.info("SIGHUP: policy reloaded from %s", policy_path)

    with capture_signals(agent.request_stop, {signal.SIGHUP: on_reload}):
        return await agent.run()


def main(argv: list[str] | None = None) -> int:
    """``python -m bridge.platform [options]``: the same as ``tft-bridge platform [options]``."""
    parser = argparse.ArgumentParser(prog="tft-bridge")
    add_platform_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["platform", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))
