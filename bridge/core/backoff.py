"""Capped exponential backoff with jitter, for every retry loop of the bridge and the
platform agent (ClusterD's streams through ``bridge.job.session.stream_loop``, the report
relay, the PodGroup watcher). Not thread-safe: one owner per instance."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Backoff:
    """``initial`` doubling up to ``cap``; each delay drawn from its upper half (jitter
    keeps many clients from retrying in step)."""

    initial: float
    cap: float
    attempt: int = 0

    def next(self) -> float:
        delay = min(self.cap, self.initial * (2 ** self.attempt))
        self.attempt += 1
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        self.attempt = 0
