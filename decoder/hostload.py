"""The machine's CPU time as Linux counts it, for telling a timing taken alone from one beside
other work (``decoder.models.formats``' format measurement, ``decoder.engines.amx_rows``)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_jiffies() -> tuple[int, int] | None:
    """(the machine's busy CPU time, this process's CPU time), both in clock ticks, from Linux's
    /proc/stat (user, nice, system, irq, softirq, steal) and /proc/self/stat (utime, stime: all
    its threads); None where they cannot be read."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return v[0] + v[1] + v[2] + v[5] + v[6] + v[7], int(own[11]) + int(own[12])
    except (OSError, ValueError, IndexError):
        return None


def others_share(before: tuple[int, int] | None, after: tuple[int, int] | None, seconds: float, cpus: int,
                 hz: int | None = None) -> float | None:
    """The share (0..1) of ``cpus`` CPUs over ``seconds`` that other processes (and the hypervisor's
    steal) used between two :func:`cpu_jiffies` snapshots; ``hz``: clock ticks per second
    (default ``os.sysconf("SC_CLK_TCK")``), at most 1. None without both snapshots, over less than
    one clock tick, or where a counter went back.
    A timing taken while they used the CPUs says little about this CPU alone (a format measured beside
    the test suite came out slower than the packaged file, and faster alone: docs/walkthroughs.md,
    the run at d482237)."""
    if before is None or after is None or not seconds > 0 or cpus < 1:
        return None
    hz = hz or os.sysconf("SC_CLK_TCK")
    if seconds * hz < 1 or after[0] < before[0] or after[1] < before[1]:
        return None  # under one clock tick, or a counter that went back (a wrap, a restarted container): unknown
    other = (after[0] - before[0]) - (after[1] - before[1])
    return min(1.0, max(0.0, other / hz / (seconds * cpus)))  # ticks are coarse: never above all the CPUs
