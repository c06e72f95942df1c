"""``tft-bridge node``: the per-node service that starts, adopts and stops the bridge of
every opted-in training job whose controller pod is bound to this node
(docs/node-service.md).

Exit codes: 0 stopped by SIGTERM/SIGINT (the bridges keep running); 1 start-up failed
(no Kubernetes client or credentials, metrics port taken); 2 bad configuration.

Needs the ``node`` extra (the Kubernetes client). Modules: ``config`` (the node TOML),
``podspec`` (a pod -> its bridge or a refusal), ``jobconfig`` (the bridge's generated
TOML), ``kube`` (pods and Events), ``launcher`` and ``keeper`` (bridges that outlive the
service), ``procs`` (process identity), ``metrics`` (the node's endpoint), ``service``
(the loop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..interrupts import capture_signals
from ..logs import setup_logging

log = logging.getLogger("tft_bridge.node")

DEFAULT_CONFIG = "/etc/tft-bridge/node.toml"
#: Not passed to a bridge: the MindCluster variables (the generated file is the whole
#: configuration) and the service's own systemd notification and watchdog variables.
CHILD_ENV_DROPPED = ("MINDX_TASK_ID", "MINDX_SERVER_IP", "POD_IP", "TTP_PORT", "WORLD_SIZE", "MS_WORKER_NUM",
                     "PROCESS_RECOVER", "HIGH_AVAILABILITY", "MINDIO_WAIT_MINDX_TIME", "HCCL_CONNECT_TIMEOUT",
                     "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "STATE_DIRECTORY", "RUNTIME_DIRECTORY",
                     "INVOCATION_ID", "LISTEN_FDS", "LISTEN_PID")


def add_node_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "node", help="run the node service: a bridge for every opted-in job whose controller pod is on this node",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"the node's TOML file (default {DEFAULT_CONFIG})")
    parser.add_argument("--check", action="store_true", help="validate the file, print it as JSON and exit")
    parser.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.set_defaults(func=cmd_node)


def child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in CHILD_ENV_DROPPED}


def bridge_argv_for(command: tuple[str, ...]) -> Any:
    base = list(command) or [sys.executable, "-m", "bridge.cli"]
    return lambda path: [*base, "run", "--config", str(path)]


def cmd_node(args: argparse.Namespace) -> int:
    from .config import NodeConfigError, load_node_config

    try:
        config = load_node_config(args.config)
    except NodeConfigError as error:
        print(error, file=sys.stderr)
        return 2
    if args.check:
        print(json.dumps(asdict(config), indent=2))
        return 0
    setup_logging(args.log_level or config.log_level)
    from .launcher import choose_launcher, sandbox_problems

    launcher = choose_launcher(config.node.launcher, child_env())
    if launcher.kind == "systemd" or os.environ.get("INVOCATION_ID"):
        paths: dict[str, str] = {"node.state_root": config.node.state_root, "the Python environment": sys.prefix,
                                 "the bridge package": str(Path(__file__).resolve().parent.parent)}
        if config.node.bridge_command:
            paths["node.bridge_command"] = config.node.bridge_command[0]
        problems = sandbox_problems(paths)
        if problems:
            for line in problems:
                log.error("%s", line)
            return 2
    from ..metrics_http import MetricsServer
    from ..platform.kube import MissingClient, api_client
    from ..systemd import Notifier
    from .kube import PodApi
    from .metrics import BridgeSeries, NodeMetrics
    from .service import NodeService

    k = config.kubernetes
    try:
        client = api_client(k.kubeconfig or None, k.context or None, k.server or None)
    except MissingClient:
        log.error("the node service needs the Kubernetes client: pip install 'tft-bridge[node]'")
        return 1
    except Exception as error:  # no kubeconfig, no service account: say which
        log.error("no Kubernetes credentials: %s", error)
        return 1
    api = PodApi(client, config.node_name, request_timeout=k.request_timeout, connect_timeout=k.connect_timeout)
    metrics = NodeMetrics()
    env = child_env()
    Path(config.node.state_root).mkdir(parents=True, exist_ok=True)
    notifier = Notifier()
    service = NodeService(config, api, launcher, metrics,
                          bridge_argv=bridge_argv_for(config.node.bridge_command), env=env, notifier=notifier)
    series = BridgeSeries(lambda: service.targets, timeout=config.metrics.scrape_timeout)
    metrics.registry.register(series)  # type: ignore[arg-type]
    server = None
    if config.metrics.enabled:
        try:
            server = MetricsServer(metrics, config.metrics.address, config.metrics.port)
        except OSError as error:
            log.error("metrics endpoint %s:%d: %s", config.metrics.address, config.metrics.port, error)
            return 1
        log.info("metrics on http://%s:%d/metrics", config.metrics.address, server.port)
    log.info("node service for node %s (selector %s, launcher %s, state %s)", config.node_name,
             config.node.selector, service.launcher.kind, config.node.state_root)

    async def main() -> int:
        with capture_signals(service.request_stop):
            return await asyncio.to_thread(service.run)

    try:
        return asyncio.run(main())
    finally:
        notifier.stopping("leaving every bridge running")
        series.close()
        if server is not None:
            server.close()
        api.close()
