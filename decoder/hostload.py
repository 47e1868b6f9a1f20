"""The machine's CPU time as Linux counts it, for telling a timing taken alone from one beside
other work (``decoder.models.formats``' format measurement, ``decoder.engines.amx_rows``)."""

from __future__ import annotations

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
