"""A token bucket: a client's requests or tokens per minute (router/ratelimit.py, and the
table a replica's processes share, router/shared_limits.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Bucket:
    capacity: float
    level: float
    stamp: float

    def take(self, n: float, now: float) -> float:
        """Take ``n`` if there is as much; else 0 is taken and the seconds until there
        will be are returned. A request larger than a minute's budget is taken once the
        bucket is full, leaving it in debt (the bucket holds at least one request of any
        size, and the rate still holds: the debt refills before the next)."""
        rate = self.capacity / 60.0
        self.level = min(self.capacity, self.level + (now - self.stamp) * rate)
        self.stamp = now
        if n <= self.level or (n > self.capacity and self.level >= self.capacity):
            self.level -= n
            return 0.0
        return (min(n, self.capacity) - self.level) / rate

    def give(self, n: float, now: float) -> None:
        """``n`` taken before and not used, back (up to the capacity; a debt shrinks)."""
        rate = self.capacity / 60.0
        self.level = min(self.capacity, self.level + (now - self.stamp) * rate + n)
        self.stamp = now
