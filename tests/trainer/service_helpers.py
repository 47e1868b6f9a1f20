"""Buffer helpers shared by the trainer service tests."""

from __future__ import annotations

from store.buffer import SampleWriter, group_info


def write(client, cfg, samples):
    """Write ``samples`` to the buffer and wait until Redis has them all."""
    with SampleWriter(client, cfg) as w:
        for s in samples:
            assert w.submit(s)
        assert w.flush(10)


def pending(client, cfg) -> int:
    """Entries delivered to the trainer's consumer group and not acked."""
    return next(g.pending for g in group_info(client, cfg) if g.name == "trainer")
