"""Configuration of ``store`` and the Redis key names derived from it.

Library code never reads the environment: the daemon builds a :class:`StoreConfig` (it is a plain
pydantic model, so it nests under a ``pydantic-settings`` ``BaseSettings`` as the ``store`` group)
and passes it to :class:`~store.buffer.SampleWriter`, :class:`~store.buffer.SampleReader`,
:class:`~store.registry.AdapterRegistry` and :class:`~store.history.AcceptanceHistory`.

Key names (``P`` = ``key_prefix``, default ``"draftd:"``)::

    P samples                          stream of VerifiedSample entries (buffer.stream)
    P samples:dead                     dead-letter stream (malformed entries, with reasons)
    P samples:processed:{group}        zset record_id -> ack time, for idempotent consumers
    P adapter:next_version             INCR counter of adapter versions
    P adapter:versions                 zset version -> version
    P adapter:v:{N}                    hash, metadata of adapter version N
    P adapter:blob:{N}                 hash filename -> bytes (only with store_bytes=True)
    P adapter:active                   int, the shared scope's active version (missing/0 = base draft)
    P adapter:active_stack             list of versions made active by promote(), for rollback()
    P adapter:active:w:{workload}      int, a workload scope's active version (missing/0 = use the shared one)
    P adapter:active_stack:w:{workload}  that scope's rollback stack
    P adapter:scopes                   set of workload scopes that ever had an adapter registered
    P adapter:promotions               stream, the promotion log (promote and rollback events)
    P adapter:fence                    int, the highest fencing token a registry write carried (store.lease)
    P adapter:events                   pub/sub channel, JSON {event, version, previous, reason, ts, scope}
    P hist:index                       zset "{bucket}|{version}|{workload}" -> bucket start (s)
    P hist:{version}:{bucket}:{workload}   hash of counts for one (workload, version, bucket)
    P head:*                           the head registry: the adapter:* layout under ``head:``
    P head:hist:index, P head:hist:{version}:{bucket}:{workload}
                                       the head history: the requests the head proposed for, by head version
    P draft:hist:...                   the same for the requests the draft model proposed for, by adapter version

Hash tags (Redis Cluster): with ``hash_tags`` on, each group of keys that a Lua script or a
MULTI/EXEC touches together carries one hash tag right after the prefix, so the group lives in
one cluster slot: ``P{samples}``, ``P{samples}:dead``, ``P{samples}:processed:{group}`` (the
stream's name is the tag: another ``buffer.stream`` lands on another slot); ``P{adapter}:...`` and
``P{head}:...`` (every registry key of a kind: the promote/rollback scripts reach a version's hash
by name); ``P{hist}:...`` and ``P{head:hist}:...`` (a history's buckets, index and applied marks).
Pub/sub channels are not keys and keep their names. Off by default (single node: the names above,
exactly as older builds wrote them); ``None`` = on when the client is a ``RedisCluster``
(:func:`resolve_config`), which is how ``redis+cluster://`` URLs get it. The tagged names are
valid single-node names too (``hash_tags=True`` on a single node works, under other names).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, Field


class BufferConfig(BaseModel):
    """The verified-sample stream, the decoder-side writer queue and the reader."""

    stream: str = "samples"  # stream key suffix; the dead-letter stream is f"{stream}:dead"
    maxlen: int = Field(100_000, gt=0)  # approximate cap on entries (XADD MAXLEN ~)
    # approximate cap on the entries' bytes: the writer lowers MAXLEN to the number of its newest
    # entries that fit in max_bytes (whatever their sizes), so records that carry hidden states (6.9x a schema 1 record's rows for
    # SmolLM2-135M) keep the same memory bound, in fewer entries; None = the count cap only
    max_bytes: int | None = Field(1 << 30, gt=0)
    max_age_s: float | None = Field(24 * 3600.0, gt=0)  # entries older than this are trimmed (XTRIM MINID ~); None = no age cap
    dead_letter_maxlen: int | None = Field(100_000, gt=0)  # approximate cap of the dead-letter stream; None = unbounded
    dead_letter_excerpt_bytes: int = Field(4096, ge=0)  # bytes of the original entry a dead letter keeps (with its reason and id)
    queue_size: int = Field(10_000, gt=0)  # writer's in-memory queue, samples; when full the oldest is dropped
    queue_max_bytes: int | None = Field(512 << 20, gt=0)  # ... or when its samples' arrays pass this (None: count only)
    batch_size: int = Field(256, gt=0)  # samples per XADD pipeline
    flush_interval_s: float = Field(0.05, gt=0)  # writer thread wakes at least this often
    backoff_initial_s: float = Field(0.05, gt=0)  # first retry delay while Redis is down
    backoff_max_s: float = Field(2.0, gt=0)  # retry delay cap while Redis is down
    trim_interval_s: float = Field(5.0, gt=0)  # how often the writer trims by age
    processed_ttl_s: float = Field(7 * 24 * 3600.0, gt=0)  # how long acked record ids are remembered for dedupe


class HistoryConfig(BaseModel):
    """Time-bucketed acceptance counts."""

    bucket_s: int = Field(10, gt=0)  # bucket width, seconds; a bucket starts at floor(ts / bucket_s) * bucket_s
    retention_s: int = Field(7 * 24 * 3600, gt=0)  # buckets expire this long after their last write


class StoreConfig(BaseModel):
    """Everything ``store`` needs besides a Redis client (and, for the registry, a directory)."""

    key_prefix: str = "draftd:"  # prefix of every key and channel; tests use a unique one
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    history: HistoryConfig = Field(default_factory=HistoryConfig)
    # hash-tagged key names (see the module docstring): True for Redis Cluster; None = decide by
    # the client (resolve_config: on for a RedisCluster); False = the single-node names
    hash_tags: bool | None = None

    @property
    def keys(self) -> "Keys":
        return Keys(self.key_prefix, self.buffer.stream, tagged=bool(self.hash_tags))


def is_cluster_client(client: object) -> bool:
    """True for redis-py's ``RedisCluster`` (without importing redis when it is not loaded)."""
    return any(c.__name__ == "RedisCluster" for c in type(client).__mro__)


def resolve_config(config: StoreConfig, client: object) -> StoreConfig:
    """``config`` with ``hash_tags`` decided for ``client``: unset -> on for a cluster client.

    Raises:
        ValueError: ``hash_tags=False`` with a cluster client (scripts and MULTI blocks would touch
            several slots and fail with CROSSSLOT).
    """
    cluster = is_cluster_client(client)
    if config.hash_tags is None:
        return config.model_copy(update={"hash_tags": cluster})
    if cluster and not config.hash_tags:
        raise ValueError(
            "store.hash_tags is false but the client is a Redis Cluster: the registry's and history's scripts "
            "touch several keys, which must share a slot. Leave store.hash_tags unset (or true) for a cluster"
        )
    return config


@dataclass(frozen=True)
class Keys:
    """Redis key names for one prefix (see the module docstring)."""

    prefix: str
    stream_name: str = "samples"
    # what the registry keys hold: "adapter" (LoRA adapters of the draft) or "head" (the
    # feature-level proposer's heads, ``P head:...``: the same layout, versions and scopes)
    kind: str = "adapter"
    tagged: bool = False  # hash tags for Redis Cluster (module docstring)

    def _root(self, group: str) -> str:
        """``P group`` or, tagged, ``P{group}``: every key of ``group`` starts with it."""
        return f"{self.prefix}{{{group}}}" if self.tagged else f"{self.prefix}{group}"

    @property
    def stream(self) -> str:
        return self._root(self.stream_name)

    @property
    def dead_letter(self) -> str:
        return f"{self.stream}:dead"

    def processed(self, group: str) -> str:
        return f"{self.stream}:processed:{group}"

    @property
    def adapter_counter(self) -> str:
        return f"{self._root(self.kind)}:next_version"

    @property
    def adapter_versions(self) -> str:
        return f"{self._root(self.kind)}:versions"

    def adapter(self, version: int) -> str:
        return f"{self._root(self.kind)}:v:{version}"

    def adapter_blob(self, version: int) -> str:
        return f"{self._root(self.kind)}:blob:{version}"

    @property
    def active(self) -> str:
        return f"{self._root(self.kind)}:active"

    @property
    def active_stack(self) -> str:
        return f"{self._root(self.kind)}:active_stack"

    def active_in(self, scope: str) -> str:
        """The active-version key of ``scope`` ("" = shared: :attr:`active`)."""
        return self.active if not scope else f"{self._root(self.kind)}:active:w:{scope}"

    def active_stack_in(self, scope: str) -> str:
        """The rollback stack of ``scope`` ("" = shared: :attr:`active_stack`)."""
        return self.active_stack if not scope else f"{self._root(self.kind)}:active_stack:w:{scope}"

    @property
    def adapter_scopes(self) -> str:
        return f"{self._root(self.kind)}:scopes"

    @property
    def promotions(self) -> str:
        return f"{self._root(self.kind)}:promotions"

    @property
    def fence(self) -> str:
        """The highest fencing token a registry write carried (store.lease); lower ones are refused."""
        return f"{self._root(self.kind)}:fence"

    @property
    def adapter_root(self) -> str:
        """The prefix of a version's hash name (``adapter(N) == adapter_root + str(N)``)."""
        return f"{self._root(self.kind)}:v:"

    @property
    def events_channel(self) -> str:  # a channel, not a key: never tagged
        return f"{self.prefix}{self.kind}:events"

    @property
    def _hist(self) -> str:
        """The acceptance history's key root: ``P hist:`` for adapter versions (the keys older
        builds wrote), ``P head:hist:`` for head versions (``AcceptanceHistory(kind="head")``),
        ``P draft:hist:`` for the draft-proposed requests by adapter version (``kind="draft"``)."""
        return f"{self._root('hist')}:" if self.kind == "adapter" else f"{self._root(self.kind + ':hist')}:"

    @property
    def history_index(self) -> str:
        return f"{self._hist}index"

    def history_bucket(self, workload: str, version: int, bucket: int) -> bytes:
        return f"{self._hist}{version}:{bucket}:{workload}".encode("utf-8")

    def history_applied(self, writer: str) -> str:
        """The last seq each (version, workload) of one history writer had applied (``AcceptanceHistory.record``)."""
        return f"{self._hist}applied:{writer}"
