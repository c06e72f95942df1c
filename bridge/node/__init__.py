"""``tft-bridge node``: the per-node service that starts, adopts and stops the bridge of
every opted-in training job whose controller pod is bound to this node
(docs/node-service.md).

Exit codes: 0 stopped by SIGTERM/SIGINT (the bridges keep running); 1 start-up failed
(no Kubernetes client, metrics port taken); 2 bad configuration (the node file; Kubernetes
credentials missing, empty or without a token; or a node name the API server has no Node
of): systemd does not restart it.

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

from bridge.core.interrupts import capture_signals
from bridge.core.logs import setup_logging

log = logging.getLogger("tft_bridge.node")

DEFAULT_CONFIG = "/etc/tft-bridge/node.toml"
#: Not passed to a bridge: the MindCluster variables (the generated file is the whole
#: configuration) and the service's own systemd notification and watchdog variables.
CHILD_ENV_DROPPED = ("MINDX_TASK_ID", "MINDX_SERVER_IP", "POD_IP", "TTP_PORT", "WORLD_SIZE", "MS_WORKER_NUM",
                     "PROCESS_RECOVER", "HIGH_AVAILABILITY", "MINDIO_WAIT_MINDX_TIME", "HCCL_CONNECT_TIMEOUT",
                     "LOCAL_PROXY_ENABLE",
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


def check_node_name(api: Any, name: str, source: str) -> str | None:
    """The problem with ``name`` as this node's name (None: the API server has that Node,
    or could not be asked now: then a warning, and the service starts; its watch retries).
    ``api`` is a ``PodApi``; ``source`` says where the name came from."""
    from bridge.core.kube import KubeError, NotFound

    try:
        api.node(name)
    except NotFound:
        return (f"the node name {name!r} (from {source}) is not the name of a Node of the cluster: the service "
                f"would watch the pods bound to a node that does not exist and serve none. Set node.name to the "
                f"Node's name (`kubectl get nodes -o wide` lists names and addresses) or export NODE_NAME")
    except KubeError as error:
        hint = " (contrib/kubernetes/rbac.yaml grants `get` on nodes)" if error.status == 403 else ""
        log.warning("cannot check that node %r (from %s) is a Node of the cluster: %s%s; starting anyway", name,
                    source, error, hint)
    return None


def cmd_node(args: argparse.Namespace) -> int:
    from bridge.node.config import NodeConfigError, load_node_config, node_config_warnings

    try:
        config = load_node_config(args.config)
    except NodeConfigError as error:
        print(error, file=sys.stderr)
        return 2
    warnings = node_config_warnings(config)
    if args.check:
        for line in warnings:
            print(f"warning: {line}", file=sys.stderr)
        print(json.dumps(asdict(config), indent=2))
        return 0
    setup_logging(args.log_level or config.log_level)
    # urllib3 logs each of its own quick connect retries as a WARNING; the pod watch says the
    # same in one line per retry of its own (bridge/core/kube_watch.py)
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    for line in warnings:
        log.warning("%s", line)
    from bridge.node.launcher import choose_launcher, sandbox_problems

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
    from bridge.core.metrics_http import MetricsServer
    from bridge.core.kube import MissingClient, api_client
    from bridge.core.systemd import Notifier
    from bridge.node.kube import PodApi
    from bridge.node.metrics import BridgeSeries, NodeMetrics
    from bridge.node.service import NodeService

    from bridge.node.kube import credentials_problem

    k = config.kubernetes
    problem = credentials_problem(k.kubeconfig, k.context, k.server, args.config)
    if problem is not None:  # a configuration problem: exit 2, not restarted until it is fixed
        log.error("no Kubernetes credentials: %s", problem)
        return 2
    try:
        client = api_client(k.kubeconfig or None, k.context or None, k.server or None)
    except MissingClient:
        log.error("the node service needs the Kubernetes client: pip install 'tft-bridge[node]'")
        return 1
    except Exception as error:  # what the client makes of a file that looked usable
        log.error("no Kubernetes credentials from %s: %s", k.kubeconfig or "the in-cluster service account", error)
        return 2
    api = PodApi(client, config.node_name, request_timeout=k.request_timeout, connect_timeout=k.connect_timeout)
    source = config.node_name_source
    problem = check_node_name(api, config.node_name, f"{source} in {args.config}" if source == "node.name" else source)
    if problem is not None:
        log.error("%s", problem)
        api.close()
        return 2
    metrics = NodeMetrics()
    env = child_env()
    Path(config.node.state_root).mkdir(parents=True, exist_ok=True)
    notifier = Notifier()
    service = NodeService(config, api, launcher, metrics,
                          bridge_argv=bridge_argv_for(config.node.bridge_command), env=env, notifier=notifier)
    series = BridgeSeries(lambda: service.targets, timeout=config.metrics.scrape_timeout,
                          served=lambda: service.served)
    metrics.registry.register(series)  # type: ignore[arg-type]
    server = None
    if config.metrics.enabled:
        try:
            m = config.metrics
            server = MetricsServer(metrics, m.address, m.port, certfile=m.certfile, keyfile=m.keyfile,
                                   client_cafile=m.client_cafile)
            server.start()
        except (OSError, ValueError) as error:  # ssl.SSLError is an OSError: a bad certificate or key
            log.error("metrics endpoint %s:%d: %s", config.metrics.address, config.metrics.port, error)
            return 1
        log.info("metrics on %s://%s:%d/metrics", "https" if config.metrics.certfile else "http",
                 config.metrics.address, server.port)

    async def main() -> int:
        with capture_signals(service.request_stop):
            # logged once SIGTERM asks for a graceful stop: a stop sent after this line exits 0
            log.info("node service for node %s (selector %s, launcher %s, state %s)", config.node_name,
                     config.node.selector, service.launcher.kind, config.node.state_root)
            return await asyncio.to_thread(service.run)

    try:
        return asyncio.run(main())
    finally:
        notifier.stopping("leaving every bridge running")
        series.close()
        if server is not None:
            server.stop()
        api.close()
