"""A trainer-like child process for the lease tests: holds or waits for the trainer lease and,
while it leads, registers and promotes an adapter every 50 ms with its fencing token (the reason
names its holder and token). Prints "LEADING <token> <monotonic>" when it takes the lease.

argv: redis url, key prefix, holder name, artifact dir, ttl seconds."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from store.client import connect  # noqa: E402
from store.config import StoreConfig  # noqa: E402
from store.errors import FencedError  # noqa: E402
from store.lease import Lease, Leadership  # noqa: E402
from store.registry import AdapterMeta, AdapterRegistry  # noqa: E402
from test_store_registry import peft_dir  # noqa: E402

url, prefix, holder, art, ttl = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]), float(sys.argv[5])
client = connect(url)
cfg = StoreConfig(key_prefix=prefix)
reg = AdapterRegistry(client, art / "registry", cfg)


def acquired(token: int) -> None:
    reg.fencing_token = token
    reg.fence(token)
    print(f"LEADING {token} {time.time()}", flush=True)


lead = Leadership(Lease(client, cfg, holder, ttl_s=ttl), acquired).start()
i = 0
while True:
    time.sleep(0.05)
    if not lead.leading:
        continue
    i += 1
    try:
        v = reg.register(peft_dir(art / f"{holder}-{i}", i), AdapterMeta())
        reg.promote(v, f"{holder} token {lead.token}")
    except FencedError as e:
        print(f"FENCED {e}", flush=True)
