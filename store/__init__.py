"""store: every byte that crosses between decoder, trainer and operator, on Redis.

- :mod:`store.schema`: the versioned ``VerifiedSample`` record (encode/decode).
- :mod:`store.client`: ``connect(url)`` with the Redis >= 6.2 check; the exception hierarchy.
- :mod:`store.config`: ``StoreConfig`` and the Redis key names.
- :mod:`store.buffer`: ``SampleWriter`` (decoder side, never blocks) and ``SampleReader``
  (trainer side, consumer group, dead-letter, dedupe) on one Redis Stream.
- :mod:`store.registry`: ``AdapterRegistry`` (versions, artifacts + sha256, atomic promote/rollback).
- :mod:`store.history`: ``AcceptanceHistory`` (time-bucketed acceptance counts, rates on read).
"""

from store.buffer import (
    DeadLetter,
    Entry,
    GroupInfo,
    SampleReader,
    SampleWriter,
    WriterStats,
    dead_letter_count,
    group_info,
    list_dead_letters,
    stream_depth,
)
from store.client import connect
from store.config import BufferConfig, HistoryConfig, StoreConfig
from store.errors import (
    ArtifactMissingError,
    IntegrityError,
    InvalidTransitionError,
    RedisVersionError,
    RegistryError,
    StoreError,
    StoreUnavailableError,
    UnknownVersionError,
)
from store.history import AcceptanceHistory, HistoryRow
from store.registry import AdapterMeta, AdapterRecord, AdapterRegistry, check_scope, parse_event
from store.schema import PairFingerprint, SamplingSettings, SchemaError, VerifiedSample, decode, encode
