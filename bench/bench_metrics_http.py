"""Metrics endpoint under idle, slow and many concurrent scrapers, for the bridge's bounded server
(bridge/core/metrics_http.py) and prometheus_client's default server in the same run.

    python bench/bench_metrics_http.py [--idle 1000] [--scrapers 200] [--scrapes 5] [--scrape-timeout 10]

Each server runs alone in a child process serving a bridge registry with realistic
series, on loopback. The parent first opens ``--idle`` connections that never finish a
request (half send nothing, half a partial request line) and holds them, then, with
those still open, runs ``--scrapers`` concurrent scrapers that each scrape ``--scrapes``
times in a row, a new connection per scrape (``Connection: close``), each scrape bounded
by ``--scrape-timeout`` (Prometheus's default scrape_timeout is 10 s). It prints, per
server: the child's thread count with the idle connections held and its peak during the
scrapes, scrapes that timed out or failed, and the latency p50/p99/max (nearest rank,
over every scrape; a timed-out scrape counts as the timeout). Everything is bounded: the
run stops by itself after at most a few minutes.

Exit status 1 if the bridge's server lets a scrape time out or fail, or grows threads.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field

SERVERS = ("bridge.core.metrics_http", "prometheus_client")


# --------------------------------------------------------------------------- the child: one server

def serve(kind: str) -> None:
    from prometheus_client import start_http_server

    from bridge.job.metrics import BridgeMetrics
    from bridge.core.metrics_http import MetricsServer

    raise_fd_limit()
    metrics = BridgeMetrics()
    for method in ("Init", "Register", "SubscribeProcessManageSignal", "ReportProcessFault", "ReportStopComplete",
                   "ReportRecoverStrategy", "ReportRecoverStatus"):
        for code in ("0", "UNAVAILABLE", "DEADLINE_EXCEEDED"):
            metrics.rpcs.labels(method, code).inc()
        metrics.rpc_seconds.labels(method).observe(0.002)
    for strategy in ("retry", "recover", "dump", "exit"):
        metrics.recovery_seconds.labels(strategy).observe(12.0)
        metrics.recovery_cycles.labels(strategy, "success").inc()
    if kind == "prometheus_client":
        server, _thread = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
        port, close = server.server_port, server.shutdown
    else:
        bounded = MetricsServer(metrics, "127.0.0.1", 0)
        bounded.start()
        port, close = bounded.port, bounded.stop
    print(port, flush=True)
    sys.stdin.read()  # the parent closes stdin when it is done
    close()


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --------------------------------------------------------------------------- the parent: the load

@dataclass
class Result:
    server: str
    idle_opened: int = 0
    idle_failed: int = 0
    threads_idle: int = 0
    threads_peak: int = 0
    latencies: list[float] = field(default_factory=list)
    timeouts: int = 0
    errors: int = 0

    def percentile(self, p: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)] if ordered else float("nan")


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


async def open_idle(port: int, partial: bool, timeout: float) -> asyncio.StreamWriter | None:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    except (OSError, asyncio.TimeoutError):
        return None
    if partial:
        writer.write(b"GET /metrics HTT")
    return writer


async def scrape_once(port: int, timeout: float) -> tuple[str, float]:
    started = time.monotonic()

    async def exchange() -> bool:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            body = await reader.read()  # to EOF
            return body.startswith(b"HTTP/1.") and b" 200 " in body[:16] and b"tft_bridge_build_info" in body
        finally:
            writer.close()

    try:
        ok = await asyncio.wait_for(exchange(), timeout)
    except asyncio.TimeoutError:
        return "timeout", timeout
    except OSError:
        return "error", time.monotonic() - started
    return ("ok" if ok else "error"), time.monotonic() - started


async def load(kind: str, pid: int, port: int, args: argparse.Namespace) -> Result:
    result = Result(kind)
    idle = await asyncio.gather(*(open_idle(port, i % 2 == 1, args.scrape_timeout) for i in range(args.idle)))
    held = [w for w in idle if w is not None]
    result.idle_opened, result.idle_failed = len(held), args.idle - len(held)
    await asyncio.sleep(args.hold)  # holding the idle connections is the load itself
    result.threads_idle = threads_of(pid)
    result.threads_peak = result.threads_idle
    done = asyncio.Event()

    async def sample_threads() -> None:
        while not done.is_set():
            result.threads_peak = max(result.threads_peak, threads_of(pid))
            await asyncio.sleep(0.1)  # the sampling period

    async def scraper() -> None:
        for _ in range(args.scrapes):
            outcome, seconds = await scrape_once(port, args.scrape_timeout)
            result.latencies.append(seconds)
            result.timeouts += outcome == "timeout"
            result.errors += outcome == "error"

    sampler = asyncio.ensure_future(sample_threads())
    await asyncio.gather(*(scraper() for _ in range(args.scrapers)))
    done.set()
    await sampler
    for writer in held:
        writer.transport.abort()
    return result


def run_one(kind: str, args: argparse.Namespace) -> Result:
    child = subprocess.Popen([sys.executable, __file__, "--serve", kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        port = int(child.stdout.readline())
        return asyncio.run(load(kind, child.pid, port, args))
    finally:
        if child.stdin:
            child.stdin.close()
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--scrapers", type=int, default=200)
    parser.add_argument("--scrapes", type=int, default=5)
    parser.add_argument("--scrape-timeout", type=float, default=10.0)
    parser.add_argument("--hold", type=float, default=2.0, help="seconds the idle connections are held before scraping")
    parser.add_argument("--only", choices=SERVERS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    raise_fd_limit()
    print(f"load: {args.idle} idle connections held ({args.idle // 2} silent, {args.idle - args.idle // 2} with a "
          f"partial request line), then {args.scrapers} concurrent scrapers x {args.scrapes} scrapes, "
          f"timeout {args.scrape_timeout:g} s, loopback, {os.cpu_count()} CPUs")
    print(f"{'server':<22}{'idle open':>10}{'thr idle':>10}{'thr peak':>10}{'scrapes':>9}{'timeout':>9}{'error':>7}"
          f"{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    failed = False
    for kind in [args.only] if args.only else SERVERS:
        r = run_one(kind, args)
        print(f"{kind:<22}{r.idle_opened:>10}{r.threads_idle:>10}{r.threads_peak:>10}{len(r.latencies):>9}"
              f"{r.timeouts:>9}{r.errors:>7}{r.percentile(50) * 1e3:>10.1f}{r.percentile(99) * 1e3:>10.1f}"
              f"{max(r.latencies, default=float('nan')) * 1e3:>10.1f}", flush=True)
        if kind == "bridge.core.metrics_http" and (r.timeouts or r.errors or r.threads_peak > 2):
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
