"""store: every byte that crosses between decoder, trainer and operator, on Redis.

- :mod:`store.schema`: the versioned ``VerifiedSample`` record (encode/decode).
- :mod:`store.client`: ``connect(url)`` with the Redis >= 6.2 check; the exception hierarchy.
- :mod:`store.config`: ``StoreConfig`` and the Redis key names.
- :mod:`store.buffer`: ``SampleWriter`` (decoder side, never blocks) and ``SampleReader``
  (trainer side, consumer group, dead-letter, dedupe) on one Redis Stream.
- :mod:`store.registry`: ``AdapterRegistry`` (versions, artifacts + sha256, atomic promote/rollback).
- :mod:`store.history`: ``AcceptanceHistory`` (time-bucketed acceptance counts, rates on read).
"""

import importlib
from typing import Any

# Names re-exported here, by the module that defines them. They are imported on first use
# (PEP 562), so `import store.config` (the settings need it) does not load redis and numpy.
_EXPORTS = {
    "store.buffer": ("DeadLetter", "Entry", "GroupInfo", "SampleReader", "SampleWriter", "WriterStats",
                     "dead_letter_count", "group_info", "list_dead_letters", "reclaimable_count", "stream_depth"),
    "store.client": ("connect",),
    "store.config": ("BufferConfig", "HistoryConfig", "StoreConfig"),
    "store.errors": ("ArtifactMissingError", "FencedError", "IntegrityError", "InvalidTransitionError", "RedisVersionError",
                     "RegistryError", "StoreError", "StoreUnavailableError", "UnknownVersionError"),
    "store.history": ("AcceptanceHistory", "HistoryRow"),
    "store.lease": ("Lease", "Leadership"),
    "store.registry": ("AdapterMeta", "AdapterRecord", "AdapterRegistry", "check_scope", "parse_event"),
    "store.schema": ("PairFingerprint", "SamplingSettings", "SchemaError", "VerifiedSample", "decode", "encode"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'store' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
