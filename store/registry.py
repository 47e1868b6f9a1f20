"""Adapter registry: versioned LoRA adapters, their metrics, and which one is active.

Versions come from ``INCR P adapter:next_version``: monotonic, never reused, possibly with gaps
(a version whose copy failed is burned). Version 0 means the base draft with no adapter.

States and transitions::

    candidate --promote()--> promoted --rollback()--> rolled_back
        |                       ^                          |
        +--set_state(rejected)  +-------promote()----------+

``promote`` is also allowed on a ``promoted`` version that is no longer active (re-promotion).
A ``rejected`` version cannot be promoted. The active version cannot be rejected: roll it back.

Artifacts: peft's ``save_pretrained`` layout (``adapter_config.json`` +
``adapter_model.safetensors``; other top-level files such as README.md are copied too,
subdirectories are not) under ``artifact_dir/v{N}``, written to a temp dir in ``artifact_dir``,
fsynced, then ``os.rename``d into place. The sha256 of every file is recorded in Redis and
checked by :meth:`AdapterRegistry.fetch`. With ``store_bytes=True`` the files are also kept in
Redis (``P adapter:blob:{N}``) so a decoder on another host can materialise them.

Scopes (per-workload adapters): every version belongs to one scope, ``""`` (shared, the default)
or a workload tag. Each scope has its own active pointer and rollback stack; promoting a version
moves only its own scope's pointer. A request of workload ``w`` is served by ``w``'s active
version, or by the shared active version when ``w`` has none (:meth:`AdapterRegistry.resolve`).
Version 0 means the base draft in the shared scope and "no adapter of its own" in a workload
scope. With only shared versions, everything behaves as a single active pointer.

Promote and rollback check the artifact first (:meth:`AdapterRegistry.artifact_problem`: every
file present with its registered sha256, the safetensors file parses, every float tensor finite):
promote refuses a bad version (``ArtifactInvalidError``, a 409 from the API) and rollback skips
bad versions on the stack (marking them ``rolled_back`` with the reason), so the active pointer
only ever lands on a version a decoder can load.

:meth:`AdapterRegistry.clean_orphans` removes what a crash leaves in ``artifact_dir``: temp
directories (``.tmp-*``, ``.stale-*``) and ``vN`` directories Redis issued but never recorded.

Promote and rollback run as one Lua script each (atomic on the server): check the state, set
the scope's active pointer (``P adapter:active`` for the shared scope), update the version's state,
append to the promotion log stream ``P adapter:promotions`` and PUBLISH on ``P adapter:events``
a JSON message::

    {"event": "promote" | "rollback", "version": <new active>, "previous": <old active>,
     "reason": "...", "ts": <seconds since the epoch>, "scope": "" | "<workload>"}

Decoders subscribe to the channel, or poll :meth:`AdapterRegistry.active_versions` (every scope).
Durability of "registered" is Redis's: run it with AOF (``appendonly yes``) if a registered
adapter must survive a Redis crash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis

from store.client import unavailable as _unavailable
from store.config import StoreConfig, resolve_config
from store.schema import MAX_WORKLOAD_LEN, WORKLOAD_RULE, workload_problem
from store.errors import ArtifactInvalidError, ArtifactMissingError, FencedError, IntegrityError, InvalidTransitionError, RegistryError, UnknownVersionError

REQUIRED_FILES = ("adapter_config.json", "adapter_model.safetensors")
HEAD_FILE = "head.safetensors"  # decoder.eagle.save_head's file: a registered head's one artifact
# what a version's directory must hold, by registry kind; the last file is the weights
ARTIFACT_FILES = {"adapter": REQUIRED_FILES, "head": (HEAD_FILE,)}
STATES = ("candidate", "promoted", "rejected", "rolled_back")

# Every write script starts with the fencing check (store.lease): KEYS[fence] holds the highest
# fencing token a write carried; a write with a lower one is refused ({'fenced', highest}); token 0
# is an unfenced write (an operator's, a single trainer without a lease) and always passes.
def _fenced(key: int, token: int) -> str:
    """The fencing check a write script starts with: the fence in KEYS[key], the token in ARGV[token]."""
    return f"""
local fence = tonumber(redis.call('GET', KEYS[{key}]) or '0')
local tok = tonumber(ARGV[{token}])
if tok > 0 and tok < fence then return {{'fenced', fence}} end
if tok > fence then redis.call('SET', KEYS[{key}], tok) end"""


_PROMOTE = _fenced(5, 6) + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {'unknown'} end
if state == 'rejected' then return {'state', state} end
local prev = tonumber(redis.call('GET', KEYS[2]) or '0')
local v = tonumber(ARGV[1])
if prev == v then return {'active'} end
redis.call('SET', KEYS[2], v)
redis.call('RPUSH', KEYS[3], v)
redis.call('HSET', KEYS[1], 'state', 'promoted', 'reason', ARGV[2], 'state_changed_at', ARGV[3])
redis.call('XADD', KEYS[4], '*', 'event', 'promote', 'version', v, 'previous', prev, 'reason', ARGV[2], 'ts', ARGV[3], 'scope', ARGV[5])
local msg = '{"event":"promote","version":' .. v .. ',"previous":' .. prev .. ',"reason":' .. cjson.encode(ARGV[2]) .. ',"ts":' .. ARGV[3] .. ',"scope":' .. cjson.encode(ARGV[5]) .. '}'
redis.call('PUBLISH', ARGV[4], msg)
return {'ok', prev}
"""

_ROLLBACK = _fenced(4, 7) + """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if cur == 0 then return {'none'} end
local top = redis.call('LINDEX', KEYS[2], -1)
if top and tonumber(top) == cur then redis.call('RPOP', KEYS[2]) end
redis.call('HSET', ARGV[1] .. cur, 'state', 'rolled_back', 'reason', ARGV[2], 'state_changed_at', ARGV[3])
local new = 0
local skip = cjson.decode(ARGV[6])
local skipped = {}
while true do
  local v = redis.call('LINDEX', KEYS[2], -1)
  if not v then break end
  local st = redis.call('HGET', ARGV[1] .. v, 'state')
  if st == 'promoted' and tonumber(v) ~= cur then
    if skip[v] then
      redis.call('HSET', ARGV[1] .. v, 'state', 'rolled_back', 'reason', 'skipped by rollback: ' .. skip[v], 'state_changed_at', ARGV[3])
      table.insert(skipped, v)
    else
      new = tonumber(v) break
    end
  end
  redis.call('RPOP', KEYS[2])
end
redis.call('SET', KEYS[1], new)
redis.call('XADD', KEYS[3], '*', 'event', 'rollback', 'version', new, 'previous', cur, 'reason', ARGV[2], 'ts', ARGV[3], 'scope', ARGV[5])
local msg = '{"event":"rollback","version":' .. new .. ',"previous":' .. cur .. ',"reason":' .. cjson.encode(ARGV[2]) .. ',"ts":' .. ARGV[3] .. ',"scope":' .. cjson.encode(ARGV[5]) .. '}'
redis.call('PUBLISH', ARGV[4], msg)
return {'ok', new, cur, unpack(skipped)}
"""

_SET_STATE = _fenced(4, 6) + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {'unknown'} end
if tonumber(redis.call('GET', KEYS[2]) or '0') == tonumber(ARGV[1]) then return {'active', state} end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'reason', ARGV[3], 'state_changed_at', ARGV[4])
redis.call('XADD', KEYS[3], '*', 'event', 'set_state', 'version', ARGV[1], 'state', ARGV[2], 'reason', ARGV[3], 'ts', ARGV[4], 'scope', ARGV[5])
return {'ok', state}
"""


# register()'s record: KEYS version hash, versions zset, scopes set, fence, blob hash. ARGV token,
# version, scope, n, then n field/value pairs of the record, then the blob's file/bytes pairs.
_RECORD_VERSION = _fenced(4, 1) + """
local n = tonumber(ARGV[4])
local h = {}
for i = 5, 4 + 2 * n do h[#h + 1] = ARGV[i] end
local b = {}
for i = 5 + 2 * n, #ARGV do b[#b + 1] = ARGV[i] end
if #b > 0 then redis.call('HSET', KEYS[5], unpack(b)) end
redis.call('HSET', KEYS[1], unpack(h))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[2])
if ARGV[3] ~= '' then redis.call('SADD', KEYS[3], ARGV[3]) end
return {'ok'}
"""

# fence(): raise the highest token seen to ARGV[1] (never lower it). Returns the highest now.
_FENCE = """
local fence = tonumber(redis.call('GET', KEYS[1]) or '0')
local tok = tonumber(ARGV[1])
if tok > fence then redis.call('SET', KEYS[1], tok) return tok end
return fence
"""


@dataclass
class AdapterMeta:
    """What the trainer knows about an adapter when it registers it.

    α is the acceptance rate measured on held-out samples (fraction of drafted tokens the
    target accepts), before (parent adapter) and after (this adapter) training.
    """

    parent: int | None = None  # version trained from; None = the active version at register time
    samples_trained: int = 0  # VerifiedSample records in the training window
    tokens_trained: int = 0  # emitted tokens distilled
    loss: float = math.nan  # final training loss
    alpha_before: float = math.nan
    alpha_after: float = math.nan
    alpha_before_by_workload: dict[str, float] = field(default_factory=dict)
    alpha_after_by_workload: dict[str, float] = field(default_factory=dict)
    scope: str = ""  # "" = shared; a workload tag = an adapter serving only that workload


@dataclass(frozen=True)
class AdapterRecord:
    """A registered adapter as stored in Redis (``P adapter:v:{N}``)."""

    version: int
    parent: int
    created_at: float  # seconds since the epoch
    samples_trained: int
    tokens_trained: int
    loss: float
    alpha_before: float
    alpha_after: float
    alpha_before_by_workload: dict[str, float]
    alpha_after_by_workload: dict[str, float]
    state: str  # one of STATES
    reason: str  # why it is in that state
    state_changed_at: float
    artifact_path: str  # the directory it was registered into (on the registering host)
    sha256: dict[str, str]  # file name -> hex digest
    has_bytes: bool  # the files are also stored in Redis
    scope: str = ""  # "" = shared; else the workload it serves (records from before scopes: "")


MAX_SCOPE_LEN = MAX_WORKLOAD_LEN  # a scope is a workload name


def check_scope(scope: str) -> str:
    """``scope`` if it is a valid adapter scope: "" (shared) or a workload name as ``serve``
    accepts it (:func:`store.schema.workload_problem`, the one rule: a served workload can have
    an adapter of its own). Raises ValueError naming it, why, and the rule."""
    if not isinstance(scope, str):
        raise ValueError(f"adapter scope {scope!r} must be a str: '' (shared) or a workload tag")
    why = workload_problem(scope, untagged_ok=True)
    if why is not None:
        raise ValueError(f"adapter scope {scope[:MAX_SCOPE_LEN + 8]!r} is not a usable workload tag: {why}; "
                         f"{WORKLOAD_RULE}; '' is the shared scope")
    return scope


_FLOAT_DTYPES = {"F16": "<f2", "F32": "<f4", "F64": "<f8"}


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a loadable safetensors file of finite tensors (None if it is).

    Parsed by hand (8-byte header length, JSON header, data) because store is torch-free and
    numpy has no bfloat16: a BF16 value is non-finite when its exponent bits are all ones."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        return f"{path.name} cannot be read: {e}"
    if len(raw) < 8:
        return f"{path.name} is truncated ({len(raw)} bytes)"
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8:
        return f"{path.name} is truncated: its header claims {n} bytes, the file has {len(raw) - 8} after the length"
    try:
        header = json.loads(raw[8 : 8 + n])
    except ValueError as e:
        return f"{path.name} has an unreadable safetensors header: {e}"
    data = memoryview(raw)[8 + n :]
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, (a, b) = info["dtype"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            return f"{path.name}: tensor {name!r} has a malformed header entry {info!r}"
        if not 0 <= a <= b <= len(data):
            return f"{path.name} is truncated: tensor {name!r} needs bytes {a}..{b}, the data has {len(data)}"
        if dtype in _FLOAT_DTYPES:
            ok = np.isfinite(np.frombuffer(data[a:b], dtype=_FLOAT_DTYPES[dtype])).all()
        elif dtype == "BF16":
            ok = not ((np.frombuffer(data[a:b], dtype="<u2") & 0x7F80) == 0x7F80).any()
        else:
            continue
        if not ok:
            return f"{path.name}: tensor {name!r} holds NaN or infinity"
    return None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_dir_atomically(dest: Path, files: dict[str, bytes | Path]) -> dict[str, str]:
    """Write ``files`` (name -> bytes or source path) into ``dest`` via a sibling temp dir and
    ``os.rename``; returns name -> sha256 of what was written."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".tmp-{dest.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    digests = {}
    try:
        for name, src in files.items():
            h = hashlib.sha256()
            with open(tmp / name, "wb") as out:
                if isinstance(src, bytes):
                    out.write(src)
                    h.update(src)
                else:
                    with open(src, "rb") as f:
                        for chunk in iter(lambda: f.read(1 << 20), b""):
                            out.write(chunk)
                            h.update(chunk)
                out.flush()
                os.fsync(out.fileno())
            digests[name] = h.hexdigest()
        _fsync_dir(tmp)
        os.rename(tmp, dest)  # atomic; fails if dest exists and is not empty
        _fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return digests


class AdapterRegistry:
    """Versioned adapters in ``artifact_dir`` + metadata, state and the active version in Redis.

    Args:
        client: a ``decode_responses=False`` client.
        artifact_dir: local directory holding ``v{N}/`` adapter directories (created if missing).
        config: store configuration (key prefix).
        clock: seconds since the epoch, injected for tests.
        kind: ``"adapter"`` (peft LoRA directories, keys ``P adapter:...``) or ``"head"`` (the
            feature-level proposer's heads: a directory holding ``head.safetensors``, written by
            ``decoder.eagle.save_head``; keys ``P head:...``). The two kinds share nothing but the
            prefix: versions, scopes, active pointers, stacks, logs and events are their own.

    Raises (any method): StoreUnavailableError when Redis is unreachable.
    """

    def __init__(
        self,
        client: redis.Redis,
        artifact_dir: str | os.PathLike,
        config: StoreConfig,
        *,
        clock: Callable[[], float] = time.time,
        kind: str = "adapter",
    ):
        if kind not in ARTIFACT_FILES:
            raise ValueError(f"registry kind {kind!r}: use one of {sorted(ARTIFACT_FILES)}")
        self.kind = kind
        self._client = client
        self.artifact_dir = Path(artifact_dir)
        self._keys = dataclasses.replace(resolve_config(config, client).keys, kind=kind)
        self._clock = clock
        self._promote = client.register_script(_PROMOTE)
        self._rollback = client.register_script(_ROLLBACK)
        self._set_state = client.register_script(_SET_STATE)
        self._record_version = client.register_script(_RECORD_VERSION)
        self._fence = client.register_script(_FENCE)
        # the fencing token this registry's writes carry (store.lease); 0 = unfenced
        self.fencing_token = 0

    def fence(self, token: int) -> int:
        """Announce fencing token ``token`` (a new lease holder's): from now on writes carrying a
        lower token are refused. Returns the highest token the registry has seen."""
        with _unavailable(f"fencing the {self.kind} registry"):
            return int(self._fence(keys=[self._keys.fence], args=[int(token)]))

    def _check_fenced(self, res: list, what: str) -> None:
        if res and res[0] in (b"fenced", "fenced"):
            raise FencedError(
                f"cannot {what}: this writer's fencing token {self.fencing_token} is older than {int(res[1])}, which a "
                f"newer holder of the trainer lease announced; this process lost its lease and must stop writing "
                f"the {self.kind} registry (it stands by; the new leader trains)"
            )

    @property
    def events_channel(self) -> str:
        """The pub/sub channel promote/rollback announce on (``P adapter:events``)."""
        return self._keys.events_channel

    def subscribe(self) -> redis.client.PubSub:
        """A PubSub already subscribed to :attr:`events_channel`; parse messages with :func:`parse_event`.

        On a Redis Cluster the subscription lives on the node serving the channel's slot; when that
        node died, redis-py keeps routing there until its slot map is refreshed, so a failed
        SUBSCRIBE refreshes it (``nodes_manager.initialize()``) and tries once more."""
        from store.client import REDIS_DOWN
        from store.config import is_cluster_client

        ps = self._client.pubsub(ignore_subscribe_messages=True)
        with _unavailable("SUBSCRIBE"):
            try:
                ps.subscribe(self.events_channel)
            except REDIS_DOWN:
                if not is_cluster_client(self._client):
                    raise
                try:
                    ps.close()
                except Exception:  # noqa: BLE001 - a broken connection may fail to close
                    pass
                self._client.nodes_manager.initialize()  # after a failover: the slot's new master
                ps = self._client.pubsub(ignore_subscribe_messages=True)
                ps.subscribe(self.events_channel)
        return ps

    # -- registration and artifacts ------------------------------------------------------------

    def register(self, src_dir: str | os.PathLike, meta: AdapterMeta, *, store_bytes: bool = False) -> int:
        """Copy a peft ``save_pretrained`` directory into ``artifact_dir/v{N}`` atomically and
        record it as a ``candidate``. Returns the new version N (>= 1).

        Raises:
            RegistryError: ``src_dir`` lacks a required file, or ``artifact_dir/v{N}`` already
                exists (Redis lost its counter while the artifact dir kept old versions).
        """
        scope = check_scope(meta.scope)
        src = Path(src_dir)
        missing = [n for n in ARTIFACT_FILES[self.kind] if not (src / n).is_file()]
        if missing:
            how = (f"model.save_pretrained({str(src)!r})" if self.kind == "adapter"
                   else f"decoder.eagle.save_head(head, {str(src / HEAD_FILE)!r}, target)")
            raise RegistryError(
                f"{src} is not a {'peft adapter' if self.kind == 'adapter' else 'head'} directory: missing "
                f"{', '.join(missing)}; write it with {how}"
            )
        files = {p.name: p for p in sorted(src.iterdir()) if p.is_file()}
        with _unavailable("INCR adapter version"):
            version = int(self._client.incr(self._keys.adapter_counter))
        dest = self.artifact_dir / f"v{version}"
        if dest.exists():
            raise RegistryError(
                f"{dest} already exists but Redis just issued version {version}: the Redis counter "
                f"{self._keys.adapter_counter!r} was reset. Restore Redis or use a fresh artifact_dir."
            )
        digests = _write_dir_atomically(dest, files)
        parent = meta.parent if meta.parent is not None else self.resolve(scope)
        now = self._clock()
        mapping = {
            "version": version,
            "parent": int(parent),
            "created_at": repr(float(now)),
            "samples_trained": int(meta.samples_trained),
            "tokens_trained": int(meta.tokens_trained),
            "loss": repr(float(meta.loss)),
            "alpha_before": repr(float(meta.alpha_before)),
            "alpha_after": repr(float(meta.alpha_after)),
            "alpha_before_by_workload": json.dumps(meta.alpha_before_by_workload, ensure_ascii=False),
            "alpha_after_by_workload": json.dumps(meta.alpha_after_by_workload, ensure_ascii=False),
            "state": "candidate",
            "reason": "registered",
            "state_changed_at": repr(float(now)),
            "artifact_path": str(dest.resolve()),
            "sha256": json.dumps(digests, sort_keys=True),
            "has_bytes": int(store_bytes),
            "scope": scope,
        }
        k = self._keys
        args: list = [int(self.fencing_token), version, scope, len(mapping)]
        for name, value in mapping.items():
            args += [name, value]
        if store_bytes:
            for name in digests:
                args += [name, (dest / name).read_bytes()]
        with _unavailable(f"recording {self.kind} v{version}"):
            res = self._record_version(keys=[k.adapter(version), k.adapter_versions, k.adapter_scopes, k.fence,
                                             k.adapter_blob(version)], args=args)
        if res and res[0] in (b"fenced", "fenced"):
            shutil.rmtree(dest, ignore_errors=True)  # never recorded: nothing names it
        self._check_fenced(res, f"register {self.kind} v{version}")
        return version

    def fetch(self, version: int, dest: str | os.PathLike | None = None) -> Path:
        """A local directory holding adapter ``version``'s files, each checked against its sha256.

        Looks in ``artifact_dir/v{N}``; if that is missing or incomplete and the bytes are in
        Redis, writes them (atomically) to ``dest`` or ``artifact_dir/v{N}`` (an incomplete local
        copy is replaced). With ``dest`` given and the local
        copy present, copies it there (atomically) and returns ``dest``.

        Raises:
            UnknownVersionError: no such version.
            IntegrityError: a file's sha256 differs from the recorded one.
            ArtifactMissingError: the files are neither local nor in Redis.
        """
        rec = self.get(version)
        local = self.artifact_dir / f"v{version}"
        target = Path(dest) if dest is not None else local
        if local.is_dir() and all((local / n).is_file() for n in rec.sha256):
            for n, want in rec.sha256.items():
                self._check(version, local / n, _sha256_file(local / n), want)
            if target.resolve() == local.resolve():
                return local
            if target.exists():
                return self._verify_existing(version, rec, target)
            got = _write_dir_atomically(target, {n: local / n for n in rec.sha256})
        else:
            if target != local and target.exists():
                return self._verify_existing(version, rec, target)
            if not rec.has_bytes:
                what = (f"{local} lacks {', '.join(n for n in rec.sha256 if not (local / n).is_file())}"
                        if local.is_dir() else f"{local} is missing")
                raise ArtifactMissingError(
                    f"{self.kind} v{version}: {what} and its bytes are not in Redis; "
                    f"copy the directory from the host that registered it ({rec.artifact_path}) "
                    f"or register with store_bytes=True (daemonctl run: trainer.adapter_bytes_in_redis=true)"
                )
            with _unavailable(f"HGETALL {self.kind} v{version} bytes"):
                blobs = self._client.hgetall(self._keys.adapter_blob(version))
            blobs = {k.decode(): v for k, v in blobs.items()}
            for n, want in rec.sha256.items():
                if n not in blobs:
                    raise ArtifactMissingError(f"{self.kind} v{version}: file {n!r} is not among the bytes stored in Redis")
                self._check(version, f"redis:{self._keys.adapter_blob(version)}[{n}]", hashlib.sha256(blobs[n]).hexdigest(), want)
            stale = None
            if target == local and local.exists():  # an incomplete local copy: restore it from Redis
                stale = local.parent / f".stale-{local.name}-{uuid.uuid4().hex[:8]}"
                os.rename(local, stale)
            try:
                got = _write_dir_atomically(target, {n: blobs[n] for n in rec.sha256})
            except BaseException:
                if stale is not None and not local.exists():
                    os.rename(stale, local)
                raise
            if stale is not None:
                shutil.rmtree(stale, ignore_errors=True)
        for n, want in rec.sha256.items():
            self._check(version, target / n, got[n], want)
        return target

    def _verify_existing(self, version: int, rec: AdapterRecord, target: Path) -> Path:
        for n, want in rec.sha256.items():
            if not (target / n).is_file():
                raise RegistryError(f"{target} exists but lacks {n}; remove it or fetch into another dest")
            self._check(version, target / n, _sha256_file(target / n), want)
        return target

    def _check(self, version: int, where: object, found: str, want: str) -> None:
        if found != want:
            raise IntegrityError(
                f"{self.kind} v{version}: {where} has sha256 {found}, registered {want}; the file is corrupt "
                f"or was replaced. Delete it and fetch again (or re-register the adapter)."
            )

    def artifact_problem(self, version: int) -> str | None:
        """Why ``version``'s artifact must not serve (None if it may): a file missing or not
        matching its registered sha256 (see :meth:`fetch`), or weights that are not a loadable
        safetensors file of finite tensors. Version 0 (the base draft) is always fine."""
        if version == 0:
            return None
        try:
            path = self.fetch(version)
        except UnknownVersionError:
            raise
        except RegistryError as e:
            return str(e)
        return safetensors_problem(path / ARTIFACT_FILES[self.kind][-1])

    def clean_orphans(self, min_age_s: float = 600.0) -> list[str]:
        """Remove from ``artifact_dir`` what crashed registrations left: temp directories
        (``.tmp-*``, ``.stale-*``) and ``vN`` directories with N at most Redis's version counter
        that no record names (the files were renamed into place, the Redis record never
        written). Only entries older than ``min_age_s`` (a registration may be in progress); a
        ``vN`` beyond the counter is left alone (Redis lost its counter: those may be another
        Redis's adapters). Returns the names removed."""
        if not self.artifact_dir.is_dir():
            return []
        now = time.time()
        with _unavailable("reading adapter versions"):
            counter = int(self._client.get(self._keys.adapter_counter) or 0)
            known = {int(v) for v in self._client.zrange(self._keys.adapter_versions, 0, -1)}
        removed = []
        for p in sorted(self.artifact_dir.iterdir()):
            try:
                if now - p.stat().st_mtime < min_age_s:
                    continue
            except OSError:
                continue
            name = p.name
            tmp = name.startswith((".tmp-", ".stale-"))
            num = name[1:] if name.startswith("v") else ""
            orphan = num.isdigit() and int(num) <= counter and int(num) not in known
            if p.is_dir() and (tmp or orphan):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(name)
        return removed

    # -- state ------------------------------------------------------------------------------------

    def _scope_of(self, version: int) -> str | None:
        """``version``'s scope ("" = shared, also for records from before scopes); None if unknown."""
        with _unavailable(f"HMGET {self.kind} v{version} scope"):
            known, raw = self._client.hmget(self._keys.adapter(version), ["version", "scope"])
        if known is None:
            return None
        return raw.decode("utf-8") if raw else ""

    def promote(self, version: int, reason: str) -> int:
        """Make ``version`` the active adapter of its scope, atomically; returns that scope's
        previously active version (0 = none / the base draft).

        Raises:
            UnknownVersionError: no such version.
            InvalidTransitionError: it is rejected, or already active.
        """
        now = self._clock()
        k = self._keys
        scope = self._scope_of(version)
        if scope is None:
            raise UnknownVersionError(f"cannot promote v{version}: no such {self.kind} version; list the registered ones with `daemonctl {self.kind}s list` (AdapterRegistry.list())")
        problem = self.artifact_problem(version)
        if problem is not None:
            raise ArtifactInvalidError(
                f"cannot promote v{version}: its artifact fails the check: {problem}. Decoders would refuse it; "
                f"promote another version or register a good adapter"
            )
        with _unavailable(f"promoting v{version}"):
            res = self._promote(
                keys=[k.adapter(version), k.active_in(scope), k.active_stack_in(scope), k.promotions, k.fence],
                args=[int(version), reason, repr(float(now)), k.events_channel, scope, int(self.fencing_token)],
            )
        self._check_fenced(res, f"promote v{version}")
        code = res[0].decode()
        if code == "unknown":
            raise UnknownVersionError(f"cannot promote v{version}: no such {self.kind} version; list the registered ones with `daemonctl {self.kind}s list` (AdapterRegistry.list())")
        if code == "state":
            raise InvalidTransitionError(
                f"cannot promote v{version}: it is {res[1].decode()}; register a new adapter instead"
            )
        if code == "active":
            raise InvalidTransitionError(f"cannot promote v{version}: it is already the active version")
        return int(res[1])

    def rollback(self, reason: str, scope: str = "") -> int:
        """:meth:`rollback_checked` without the skipped versions."""
        return self.rollback_checked(reason, scope)[0]

    def _bad_on_stack(self, scope: str, refuse_missing: bool = False) -> dict[str, str]:
        """Versions on ``scope``'s rollback stack, from the top down to the first good promoted one
        below the active version, whose artifact fails the check: version (str) -> why. With
        ``refuse_missing``, a version whose files are neither here nor in Redis raises
        ArtifactMissingError instead (absent from this host is not corrupt)."""
        k = self._keys
        with _unavailable("reading the rollback stack"):
            cur = int(self._client.get(k.active_in(scope)) or 0)
            stack = [int(v) for v in self._client.lrange(k.active_stack_in(scope), 0, -1)]
        bad: dict[str, str] = {}
        for v in reversed(stack):
            if v == cur or str(v) in bad:
                continue
            try:
                if self.get(v).state != "promoted":
                    continue
            except UnknownVersionError:
                continue
            if refuse_missing:
                try:
                    self.fetch(v)
                except ArtifactMissingError as e:
                    raise ArtifactMissingError(
                        f"{e}. Nothing was rolled back: run this where {self.artifact_dir} holds the versions "
                        f"(the host and state dir that registered them)") from e
                except RegistryError:
                    pass  # corrupt: artifact_problem says why below
            problem = self.artifact_problem(v)
            if problem is None:
                break
            bad[str(v)] = problem
        return bad

    def rollback_checked(self, reason: str, scope: str = "", *, refuse_missing: bool = False) -> tuple[int, dict[int, str]]:
        """Mark ``scope``'s active version ``rolled_back`` and reactivate the scope's previous
        promoted version that is still ``promoted`` and whose artifact passes the check,
        atomically. Returns the scope's new active version (0 when none is left: the base draft
        for the shared scope; for a workload scope, its requests fall back to the shared adapter)
        and the versions skipped because their artifact failed the check (version -> why; they
        are marked ``rolled_back`` with that reason).

        ``refuse_missing``: a version on the way whose files are neither under ``artifact_dir`` nor
        in Redis (a registry opened with another directory, on another host) raises instead of
        being skipped as bad, before anything changes.

        Raises:
            ValueError: ``scope`` is not a valid scope (see :func:`check_scope`).
            InvalidTransitionError: the scope has no active adapter.
            ArtifactMissingError: ``refuse_missing`` and a version's files are not reachable here.
        """
        check_scope(scope)
        bad = self._bad_on_stack(scope, refuse_missing)
        now = self._clock()
        k = self._keys
        with _unavailable("rollback"):
            res = self._rollback(
                keys=[k.active_in(scope), k.active_stack_in(scope), k.promotions, k.fence],
                args=[k.adapter_root, reason, repr(float(now)), k.events_channel, scope,
                      json.dumps(bad), int(self.fencing_token)],
            )
        self._check_fenced(res, f"roll back {scope or 'the shared scope'}")
        if res[0].decode() == "none":
            if scope:
                own = sorted(w for w, v in self.active_versions().items() if w and v)
                raise InvalidTransitionError(
                    f"cannot roll back workload {scope!r}: it has no active {self.kind} of its own (its requests use "
                    f"the shared one). Workloads with their own active {self.kind}: {own or 'none'}; "
                    f"to roll back the shared {self.kind}, leave the workload out"
                )
            if self.kind == "head":
                raise InvalidTransitionError("cannot roll back: no head is active (version 0: the 'eagle' proposer is "
                                             "not offered)")
            raise InvalidTransitionError("cannot roll back: no adapter is active (version 0, the base draft)")
        skipped = {int(v): bad.get(v.decode(), "") for v in res[3:]}
        return int(res[1]), skipped

    def set_state(self, version: int, state: str, reason: str) -> None:
        """Set a non-active version's state to ``candidate`` or ``rejected`` (with ``reason``).

        Raises:
            ValueError: ``state`` is not ``candidate`` or ``rejected`` (use promote()/rollback()).
            UnknownVersionError: no such version.
            InvalidTransitionError: ``version`` is active; roll it back first.
        """
        if state not in ("candidate", "rejected"):
            raise ValueError(
                f"set_state cannot set {state!r}: use 'candidate' or 'rejected'; promote() and rollback() "
                f"set 'promoted' and 'rolled_back'"
            )
        k = self._keys
        scope = self._scope_of(version)
        if scope is None:
            raise UnknownVersionError(f"cannot set state of v{version}: no such {self.kind} version")
        with _unavailable(f"set_state v{version}"):
            res = self._set_state(
                keys=[k.adapter(version), k.active_in(scope), k.promotions, k.fence],
                args=[int(version), state, reason, repr(float(self._clock())), scope, int(self.fencing_token)],
            )
        self._check_fenced(res, f"set v{version} {state}")
        code = res[0].decode()
        if code == "unknown":
            raise UnknownVersionError(f"cannot set state of v{version}: no such {self.kind} version")
        if code == "active":
            raise InvalidTransitionError(f"cannot mark v{version} {state}: it is the active version; rollback() first")

    # -- queries ----------------------------------------------------------------------------------

    def active_version(self, scope: str = "") -> int:
        """``scope``'s own active version: for the shared scope 0 = the base draft; for a
        workload scope 0 = none (its requests use the shared one, see :meth:`resolve`)."""
        check_scope(scope)
        with _unavailable("GET active version"):
            v = self._client.get(self._keys.active_in(scope))
        return int(v) if v is not None else 0

    def resolve(self, workload: str = "") -> int:
        """The version serving requests of ``workload``: its own scope's active version, else
        the shared one (0 = the base draft)."""
        check_scope(workload)
        keys = [self._keys.active] + ([self._keys.active_in(workload)] if workload else [])
        with _unavailable("MGET active versions"):
            vals = self._client.mget(keys)
        own = int(vals[-1] or 0) if workload else 0
        return own or int(vals[0] or 0)

    def scopes(self) -> list[str]:
        """The workload scopes that have had an adapter registered, sorted (the shared "" excluded)."""
        with _unavailable("SMEMBERS adapter scopes"):
            return sorted(m.decode("utf-8") for m in self._client.smembers(self._keys.adapter_scopes))

    def active_versions(self) -> dict[str, int]:
        """Every scope's own active version: ``{"": shared, workload: version or 0, ...}``."""
        scopes = [""] + self.scopes()
        with _unavailable("MGET active versions"):
            vals = self._client.mget([self._keys.active_in(s) for s in scopes])
        return {s: int(v or 0) for s, v in zip(scopes, vals)}

    def get(self, version: int) -> AdapterRecord:
        """The record of ``version``. Raises UnknownVersionError if there is none."""
        with _unavailable(f"HGETALL {self.kind} v{version}"):
            h = self._client.hgetall(self._keys.adapter(version))
        if not h:
            raise UnknownVersionError(f"no {self.kind} version {version}; list the registered ones with `daemonctl {self.kind}s list` (AdapterRegistry.list())")
        return _record(h)

    def list(self) -> list[AdapterRecord]:
        """All registered versions, oldest first."""
        with _unavailable("listing adapters"):
            versions = self._client.zrange(self._keys.adapter_versions, 0, -1)
            pipe = self._client.pipeline(transaction=False)
            for v in versions:
                pipe.hgetall(self._keys.adapter(int(v)))
            hashes = pipe.execute()
        return [_record(h) for h in hashes if h]

    def promotion_log(self, count: int = 100) -> list[dict[str, str]]:
        """The last ``count`` promote/rollback/set_state events, oldest first (str -> str)."""
        with _unavailable("XREVRANGE promotions"):
            raw = self._client.xrevrange(self._keys.promotions, count=count)
        return [{k.decode(): v.decode() for k, v in f.items()} | {"id": eid.decode()} for eid, f in reversed(raw)]


def parse_event(message: dict) -> dict:
    """Decode a pub/sub message from :attr:`AdapterRegistry.events_channel` into
    ``{"event", "version", "previous", "reason", "ts", "scope"}`` (``scope`` "" when absent)."""
    data = message["data"]
    ev = json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    ev.setdefault("scope", "")
    return ev


def _record(h: dict[bytes, bytes]) -> AdapterRecord:
    g = {k.decode(): v.decode("utf-8") for k, v in h.items()}
    return AdapterRecord(
        version=int(g["version"]),
        parent=int(g["parent"]),
        created_at=float(g["created_at"]),
        samples_trained=int(g["samples_trained"]),
        tokens_trained=int(g["tokens_trained"]),
        loss=float(g["loss"]),
        alpha_before=float(g["alpha_before"]),
        alpha_after=float(g["alpha_after"]),
        alpha_before_by_workload=json.loads(g["alpha_before_by_workload"]),
        alpha_after_by_workload=json.loads(g["alpha_after_by_workload"]),
        state=g["state"],
        reason=g["reason"],
        state_changed_at=float(g["state_changed_at"]),
        artifact_path=g["artifact_path"],
        sha256=json.loads(g["sha256"]),
        has_bytes=g.get("has_bytes") == "1",
        scope=g.get("scope", ""),
    )
