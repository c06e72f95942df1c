"""A server in a child process of its own, commanded over stdin, answering in JSON lines.

The benchmarks' ClusterDs (``remote_sim.py``, the simulation; ``fast_clusterd.py``, the
server that only decodes and answers) run outside the measured process: in it, their
decoding would compete with the bridge for the GIL. Both speak the same way to the
parent, so starting, commanding and stopping the child live here once; what a line
means is each server's own (``on_line``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any


class ChildServer:
    """The parent's side: ``start`` spawns ``argv`` and returns once the child said it
    listens; every stdout line is handed to ``on_line`` as parsed JSON."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self._process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    async def on_line(self, data: dict[str, Any]) -> None:
        raise NotImplementedError

    async def wait_listening(self) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        self._process = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=64 * 1024 * 1024)
        self._reader = asyncio.create_task(self._read())
        await self.wait_listening()

    async def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        async for line in self._process.stdout:
            await self.on_line(json.loads(line))

    async def command(self, line: str) -> None:
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write(line.encode() + b"\n")
        await self._process.stdin.drain()

    async def stop(self) -> None:
        """Close the child's stdin (its signal to stop), then wait; kill it after 10 s."""
        if self._process is None:
            return
        if self._process.returncode is None:
            assert self._process.stdin is not None
            self._process.stdin.close()
            try:
                await asyncio.wait_for(self._process.wait(), 10)
            except asyncio.TimeoutError:
                self._process.kill()
                await self._process.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
