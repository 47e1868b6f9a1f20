"""The one record that flows decoder -> Redis -> trainer: ``VerifiedSample``.

Defined once here, with explicit encode/decode and a schema version. The decoder builds a
``VerifiedSample`` per decoded request (or per chunk of a long one); the trainer distils the
target distributions it carries into the draft.

Encoding: a Redis stream entry is a flat field map. We keep a few small routing fields in the
clear (``v`` schema version, ``rid`` record id, ``w`` workload, ``fp`` model-pair fingerprint) so a
reader can dead-letter an entry without decoding the body, and one ``body`` field holding a
msgpack map whose array fields are raw little-endian numpy bytes with dtype and shape.

Array dtypes (chosen for size; see ``bench/store_bench.py`` for bytes per record):

- token ids: ``int32`` (Gemma 3's vocabulary is 262k, beyond int16/uint16);
- top-k probabilities: ``float16`` (their rounding error, <= 2^-11 relative, is far below the
  noise of one distillation step); the tail mass is computed in float32 before rounding and
  stored as ``float32`` so the teacher distribution still sums to 1 within 1e-3;
- per-step lengths and rejection positions: ``int16``;
- the target's hidden states (schema 2, optional): ``float16``, H per emitted position (1152 bytes a
  row for SmolLM2-135M's H = 576, against 196 for its top-32 row): what a feature-level head
  (``decoder.eagle``) distils from without the target. Written only when the decoder records them
  (``DecoderConfig.record_hidden``).

Schema versions: 1 (no hidden states) and 2 (with them) both decode. A record without hidden
states is written as version 1, byte for byte what the previous build wrote, so a trainer of that
build still reads a newer decoder's records during a rolling upgrade; only records that carry
hidden states are version 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import uuid
from dataclasses import dataclass, field

import msgpack
import numpy as np

from store.errors import StoreError

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)  # schema 1 records (no ``hidden`` field) decode with hidden = None
# Record sources (``VerifiedSample.source``); the body field is optional and "decode" when absent,
# so records written before it existed still decode.
SOURCES = ("decode", "prefill")

# Field names of the stream entry (bytes, as redis-py returns them with decode_responses=False).
F_VERSION = b"v"
F_RECORD_ID = b"rid"
F_WORKLOAD = b"w"
F_FINGERPRINT = b"fp"
F_BODY = b"body"


class SchemaError(StoreError, ValueError):
    """A stream entry cannot be decoded into a ``VerifiedSample``; ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


MAX_WORKLOAD_LEN = 64  # characters of a workload tag
WORKLOAD_PATTERN = rf"[^\s@]{{1,{MAX_WORKLOAD_LEN}}}"  # and printable: what `serve`, the store and adapter scopes accept
WORKLOAD_RULE = (f"a workload is a name of printable characters (at most {MAX_WORKLOAD_LEN} characters) without "
                 f"whitespace or '@' (the pattern {WORKLOAD_PATTERN}), e.g. 'code' or 'customer-42'")


def workload_problem(tag: object, *, untagged_ok: bool = True) -> str | None:
    """Why ``tag`` is not a workload name, or None: the one rule ``serve`` applies to a request's
    ``workload`` (``untagged_ok=False``), the store to a record's (where "" = untagged) and the
    registries to an adapter or head scope (:func:`store.registry.check_scope`, "" = shared), so a
    workload that is served can have an adapter of its own. At most :data:`MAX_WORKLOAD_LEN`
    printable characters (no control characters, newlines or lone surrogates), no '@' (it
    separates a workload from its sampling bucket in the controller's keys) and no whitespace
    (:data:`WORKLOAD_PATTERN`)."""
    if not isinstance(tag, str):
        return f"{tag!r:.80} is a {type(tag).__name__}, not a string"
    if not tag:
        return None if untagged_ok else "it is empty"
    if len(tag) > MAX_WORKLOAD_LEN:
        return f"longer than {MAX_WORKLOAD_LEN} characters"
    if not tag.isprintable():
        return "it holds a control character, a newline or a lone surrogate"
    if "@" in tag:
        return "it holds '@', which separates a workload from its sampling bucket"
    if tag.strip() != tag:
        return "it has surrounding spaces"
    space = next((i for i, c in enumerate(tag) if c.isspace()), None)
    if space is not None:
        return f"it holds whitespace ({tag[space]!r} at character {space})"
    return None


def check_workload(tag: object) -> str:
    """``tag`` if it is a usable workload tag (:func:`workload_problem`; "" = untagged). Raises
    SchemaError (a ValueError) naming it.

    Checked where tags enter: :func:`encode` (the writer drops such a record, counted in
    ``dropped_error``), :func:`decode` (the reader dead-letters it) and the decoder's JSONL loader."""
    why = workload_problem(tag)
    if why is not None:
        if isinstance(tag, str):
            shown = repr(tag[: MAX_WORKLOAD_LEN + 8]) + ("..." if len(tag) > MAX_WORKLOAD_LEN + 8 else "")
            shown += f" ({len(tag)} characters)"
        else:
            shown = repr(tag)[:80]
        raise SchemaError(f"workload tag {shown} is not usable: {why}; {WORKLOAD_RULE}")
    return tag


PROB_TOLERANCE = 1e-2  # float16 rows of a real distribution sum to 1 - tail within ~1e-3


def distribution_problem(topk_probs: np.ndarray) -> str | None:
    """Why the top-k rows are not a distribution's top k, or None: each row's mass must be > 0 and
    <= 1 (within :data:`PROB_TOLERANCE`). A record whose rows sum to 32 or to 0 decodes but
    would teach the draft an impossible target; the reader dead-letters it with this reason.
    Rows of width 0 (no top-k recorded) carry no mass and pass."""
    if topk_probs.ndim != 2 or topk_probs.shape[1] == 0 or topk_probs.shape[0] == 0:
        return None
    sums = topk_probs.astype(np.float64).sum(axis=1)
    off = np.flatnonzero(~((sums > 0.0) & (sums <= 1.0 + PROB_TOLERANCE)))
    if off.size:
        i = int(off[0])
        return (f"field 'topk_probs': row {i} sums to {sums[i]:.4g} ({off.size} of {sums.size} rows off): a "
                f"distribution's top-k mass is > 0 and <= 1 (tolerance {PROB_TOLERANCE})")
    return None


@dataclass(frozen=True)
class PairFingerprint:
    """Identifies the (target, draft, tokenizer) pair that produced a record.

    A trainer refuses records whose fingerprint differs from its own pair: distilling one
    target's distributions into another pair's draft would be wrong, silently.
    """

    target: str
    draft: str
    tokenizer_hash: str

    def key(self) -> str:
        """Short stable string: sha256 of the three names, first 16 hex chars."""
        h = hashlib.sha256(f"{self.target}\0{self.draft}\0{self.tokenizer_hash}".encode()).hexdigest()
        return h[:16]


@dataclass(frozen=True)
class SamplingSettings:
    """Sampling policy of the request. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass
class VerifiedSample:
    """One target-verified request (or chunk), with the target's top-k distributions.

    Shapes (N = emitted tokens, S = verification steps, k = top-k width, P = prompt tokens):

    - ``prompt_ids``: (P,) int32
    - ``output_ids``: (N,) int32, the emitted tokens (accepted draft tokens, corrections, bonus)
    - ``proposal_lens``: (S,) int16, γ used at each step (0 = a plain decoding step)
    - ``rejection_pos``: (S,) int16, index in 0..γ-1 of the first rejected proposal, -1 if all
      proposals were accepted. Accepted prefix length = rejection_pos if >= 0 else proposal_len.
    - ``topk_ids``: (N, k) int32, the target's k most probable tokens at each emitted position:
      row j is the target's distribution for output position j, i.e. p(. | prompt, output[:j]),
      which the draft's logits at sequence index P - 1 + j are distilled towards
    - ``topk_probs``: (N, k) float16, their probabilities under the target at temperature 1
      (the model's own distribution p, before the request's sampling transforms)
    - ``tail_mass``: (N,) float32, 1 - sum of the top-k probabilities (the "other" bucket)

    - ``hidden``: (N, H) float16 or None: the target's final hidden state (after its final norm)
      at the position whose distribution is row j of ``topk_ids``, i.e. at sequence index
      P - 1 + j; the feature f a feature-level head (``decoder.eagle``) is trained on. None when
      the decoder did not record them (``DecoderConfig.record_hidden``; schema 1 records).

    ``adapter_version`` is the draft adapter that proposed the tokens (0 = the base draft).

    ``target_format`` is the weight format the target was served in (``"packaged"``, ``"F16"``,
    ...: ``decoder.models.formats``, ``models.format``): the rows are that file's distributions.
    None when the decoder did not say (torch, a path target, records written before it existed).
    An optional body field, like ``source``: written only when set, so the schema version stays.

    ``source`` says where the rows come from:

    - ``"decode"``: a decoded request; ``output_ids`` were emitted by speculative (or plain)
      decoding and each row is the target's distribution from verification.
    - ``"prefill"``: teacher-forced text (a request's prompt, or corpus text during bootstrap);
      ``output_ids`` are that text after its first token (``prompt_ids`` holds the first token),
      each row is the target's distribution from one forward pass over the text (its prefill),
      and there are no steps (S = 0). Same shapes, so the trainer distils both alike; acceptance
      accounting counts only ``"decode"`` records.

    ``request_id`` groups the records of one request (its prefill and decode records). The
    trainer's held-out split hashes the whole prompt (see ``trainer.service.split_key``), which
    both records of a request share.
    """

    request_id: str
    workload: str
    adapter_version: int
    pair: PairFingerprint
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    proposal_lens: np.ndarray
    rejection_pos: np.ndarray
    topk_ids: np.ndarray
    topk_probs: np.ndarray
    tail_mass: np.ndarray
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    started_at: float = field(default_factory=time.time)
    finished_at: float = field(default_factory=time.time)
    record_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    schema_version: int = SCHEMA_VERSION
    source: str = "decode"
    hidden: np.ndarray | None = None
    target_format: str | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise SchemaError(f"source {repr(self.source)[:64]} is not one of {SOURCES}")
        self.prompt_ids = np.ascontiguousarray(self.prompt_ids, dtype=np.int32).reshape(-1)
        self.output_ids = np.ascontiguousarray(self.output_ids, dtype=np.int32).reshape(-1)
        self.proposal_lens = np.ascontiguousarray(self.proposal_lens, dtype=np.int16).reshape(-1)
        self.rejection_pos = np.ascontiguousarray(self.rejection_pos, dtype=np.int16).reshape(-1)
        n = self.output_ids.shape[0]
        self.topk_ids = _rows(np.ascontiguousarray(self.topk_ids, dtype=np.int32), n, "topk_ids")
        self.topk_probs = _rows(np.ascontiguousarray(self.topk_probs, dtype=np.float16), n, "topk_probs")
        self.tail_mass = np.ascontiguousarray(self.tail_mass, dtype=np.float32).reshape(-1)
        if self.topk_ids.shape != self.topk_probs.shape:
            raise SchemaError(
                f"topk_ids shape {self.topk_ids.shape} != topk_probs shape {self.topk_probs.shape}"
            )
        if self.tail_mass.shape[0] != n:
            raise SchemaError(f"tail_mass has {self.tail_mass.shape[0]} rows, expected {n}")
        if self.hidden is not None:
            h = np.asarray(self.hidden)
            if h.ndim != 2 or h.shape[0] != n or h.shape[1] == 0:
                raise SchemaError(f"hidden has shape {h.shape}, expected ({n}, H): one row per output token")
            with np.errstate(over="ignore", invalid="ignore"):
                self.hidden = np.ascontiguousarray(h, dtype=np.float16)
            if not np.isfinite(self.hidden).all():
                raise SchemaError("hidden holds NaN or infinity, or values beyond float16's range (65504): a reader "
                                  "would dead-letter the record")
        self.schema_version = SCHEMA_VERSION if self.hidden is not None else 1  # what encode writes
        if self.source == "prefill" and self.proposal_lens.shape[0]:
            raise SchemaError(f"a prefill record has no steps, got {self.proposal_lens.shape[0]} proposal lengths")
        if self.proposal_lens.shape != self.rejection_pos.shape:
            raise SchemaError(
                f"proposal_lens shape {self.proposal_lens.shape} != rejection_pos shape "
                f"{self.rejection_pos.shape}"
            )

    @property
    def accepted_lens(self) -> np.ndarray:
        """(S,) int: accepted prefix length per step (derived from rejection_pos)."""
        return np.where(self.rejection_pos >= 0, self.rejection_pos, self.proposal_lens).astype(np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.output_ids.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the record's arrays (hidden states included): what it holds in memory."""
        return sum(getattr(self, f).nbytes for f in _ARRAYS) + (self.hidden.nbytes if self.hidden is not None else 0)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, VerifiedSample):
            return NotImplemented
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
                    return False
                if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b):
                    return False
            elif a != b:
                return False
        return True


_ARRAYS = ("prompt_ids", "output_ids", "proposal_lens", "rejection_pos", "topk_ids", "topk_probs", "tail_mass")


def _rows(a: np.ndarray, n: int, name: str) -> np.ndarray:
    """``a`` as (n, k): one row per output token. A record with no output tokens (n = 0) keeps
    its width (0, k), or (0, 0) when it came flat. Raises SchemaError when it does not divide."""
    if a.ndim == 2 and a.shape[0] == n:
        return a
    if n == 0:
        if a.size:
            raise SchemaError(f"{name} has {a.size} values but the record has no output tokens")
        return a.reshape(0, a.shape[1] if a.ndim == 2 else 0)
    if a.size % n:
        raise SchemaError(f"{name} has {a.size} values, not a whole number of rows for {n} output tokens")
    return a.reshape(n, -1)


def _pack_array(a: np.ndarray) -> list:
    """[dtype, shape, bytes]: the bytes little-endian and the dtype saying so (``<f2``)."""
    a = np.ascontiguousarray(a)
    le = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return [le.dtype.str, list(a.shape), le.tobytes()]


def _unpack_array(v: list, name: str) -> np.ndarray:
    """The array of a packed [dtype, shape, bytes], read in the byte order its dtype names
    (``>f2`` from a big-endian writer is read as big-endian), returned in native order."""
    try:
        dtype, shape, raw = v
        arr = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
    except Exception as e:  # noqa: BLE001 - any malformed field is one reason
        raise SchemaError(f"field {name!r} is not a packed array: {e}") from e
    return arr.astype(arr.dtype.newbyteorder("="), copy=True)


_INT_ARRAYS = ("prompt_ids", "output_ids", "topk_ids", "proposal_lens", "rejection_pos")
_INT32_MAX = 2**31 - 1


def _check_arrays(a: dict[str, np.ndarray]) -> None:
    """Refuse arrays that decode but would feed the trainer wrong data (a corrupt, hand-edited or
    foreign entry): wrong dtype kind or rank, rows that do not line up with ``output_ids``,
    negative or out-of-int32 ids, probabilities that are not finite or outside [0, 1]."""
    for name in _INT_ARRAYS:
        if a[name].dtype.kind not in "iu":
            raise SchemaError(f"field {name!r} has dtype {a[name].dtype}, expected an integer array")
    for name in ("topk_probs", "tail_mass"):
        if a[name].dtype.kind != "f":
            raise SchemaError(f"field {name!r} has dtype {a[name].dtype}, expected a float array")
    for name in ("prompt_ids", "output_ids", "proposal_lens", "rejection_pos", "tail_mass"):
        if a[name].ndim != 1:
            raise SchemaError(f"field {name!r} has shape {a[name].shape}, expected 1-D")
    n = a["output_ids"].shape[0]
    for name in ("topk_ids", "topk_probs"):
        if a[name].ndim != 2 or a[name].shape[0] != n:
            raise SchemaError(f"field {name!r} has shape {a[name].shape}, expected ({n}, k): one row per output token")
    for name in ("prompt_ids", "output_ids", "topk_ids"):
        x = a[name]
        if x.size and (int(x.min()) < 0 or int(x.max()) > _INT32_MAX):
            raise SchemaError(f"field {name!r} has token ids outside 0..{_INT32_MAX} (min {x.min()}, max {x.max()})")
    probs, tail = a["topk_probs"].astype(np.float64), a["tail_mass"].astype(np.float64)
    if not (np.isfinite(probs).all() and np.isfinite(tail).all()):
        raise SchemaError("field 'topk_probs' or 'tail_mass' holds NaN or infinity")
    if probs.size and (probs.min() < 0.0 or probs.max() > 1.0):
        raise SchemaError(f"field 'topk_probs' outside [0, 1] (min {probs.min()}, max {probs.max()})")
    if tail.size and (tail.min() < -1e-3 or tail.max() > 1.0 + 1e-3):
        raise SchemaError(f"field 'tail_mass' outside [0, 1] (min {tail.min()}, max {tail.max()})")
    if a["proposal_lens"].size and int(a["proposal_lens"].min()) < 0:
        raise SchemaError("field 'proposal_lens' has a negative γ")
    why = distribution_problem(a["topk_probs"])
    if why is not None:
        raise SchemaError(why)


def _check_hidden(h: np.ndarray, n: int) -> None:
    if h.dtype.kind != "f":
        raise SchemaError(f"field 'hidden' has dtype {h.dtype}, expected a float array")
    if h.ndim != 2 or h.shape[0] != n or h.shape[1] == 0:
        raise SchemaError(f"field 'hidden' has shape {h.shape}, expected ({n}, H): one row per output token")
    with np.errstate(over="ignore", invalid="ignore"):
        if not np.isfinite(h.astype(np.float16)).all():  # as the record holds them: beyond 65504 is inf in float16
            raise SchemaError("field 'hidden' holds NaN or infinity, or values beyond float16's range (65504)")


def _check_scalars(body: dict) -> None:
    if not isinstance(body.get("request_id"), str):
        raise SchemaError(f"body field 'request_id' is {type(body.get('request_id')).__name__}, expected a string")
    pair = body.get("pair")
    if not (isinstance(pair, list) and len(pair) == 3 and all(isinstance(x, str) for x in pair)):
        raise SchemaError(f"body field 'pair' is {pair!r}, expected [target, draft, tokenizer_hash] strings")
    for name in ("started_at", "finished_at"):
        v = body.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise SchemaError(f"body field {name!r} is {v!r}, expected seconds since the epoch")
    av = body.get("adapter_version")
    if isinstance(av, bool) or not isinstance(av, int) or av < 0:
        raise SchemaError(f"body field 'adapter_version' is {av!r}, expected an integer >= 0")


def encode(sample: VerifiedSample) -> dict[bytes, bytes]:
    """Encode a sample into a Redis stream field map (bytes -> bytes).

    Raises:
        SchemaError: the workload tag is not usable (:func:`check_workload`).
    """
    check_workload(sample.workload)
    body = {
        "request_id": sample.request_id,
        "adapter_version": int(sample.adapter_version),
        "pair": [sample.pair.target, sample.pair.draft, sample.pair.tokenizer_hash],
        "sampling": [
            float(sample.sampling.temperature),
            float(sample.sampling.top_p),
            int(sample.sampling.top_k),
            sample.sampling.seed,
        ],
        "started_at": float(sample.started_at),
        "finished_at": float(sample.finished_at),
        "source": sample.source,
    }
    for name in _ARRAYS:
        body[name] = _pack_array(getattr(sample, name))
    if sample.hidden is not None:
        body["hidden"] = _pack_array(sample.hidden)
    if sample.target_format is not None:
        body["target_format"] = str(sample.target_format)
    return {
        F_VERSION: str(sample.schema_version).encode(),
        F_RECORD_ID: sample.record_id.encode(),
        F_WORKLOAD: sample.workload.encode("utf-8"),
        F_FINGERPRINT: sample.pair.key().encode(),
        F_BODY: msgpack.packb(body, use_bin_type=True),
    }


def decode(fields: dict[bytes, bytes]) -> VerifiedSample:
    """Decode a stream field map produced by :func:`encode`.

    Raises:
        SchemaError: unknown schema version, missing field, or undecodable body; ``reason``
            names the field and the problem (the caller dead-letters the entry).
    """
    fields = {(k.encode() if isinstance(k, str) else k): v for k, v in fields.items()}
    for f in (F_VERSION, F_RECORD_ID, F_WORKLOAD, F_BODY):
        if f not in fields:
            raise SchemaError(f"missing field {f.decode()!r}")
    try:
        version = int(fields[F_VERSION])
    except ValueError as e:
        raise SchemaError(f"schema version {fields[F_VERSION]!r} is not an integer") from e
    if version not in READABLE_VERSIONS:
        raise SchemaError(f"unknown schema version {version} (this build reads {', '.join(map(str, READABLE_VERSIONS))})")
    try:
        record_id = fields[F_RECORD_ID].decode("ascii")
    except UnicodeDecodeError as e:
        raise SchemaError(f"field 'rid' (record id) {fields[F_RECORD_ID][:64]!r} is not ASCII") from e
    try:
        workload = check_workload(fields[F_WORKLOAD].decode("utf-8"))
    except UnicodeDecodeError as e:
        raise SchemaError(f"field 'w' (workload) {fields[F_WORKLOAD][:64]!r} is not UTF-8") from e
    try:
        body = msgpack.unpackb(fields[F_BODY], raw=False)
    except Exception as e:  # noqa: BLE001
        raise SchemaError(f"body is not decodable: {e}") from e
    if not isinstance(body, dict):
        raise SchemaError(f"body is a {type(body).__name__}, expected a map")
    try:
        arrays = {name: _unpack_array(body[name], name) for name in _ARRAYS}
        _check_arrays(arrays)
        _check_scalars(body)
        hidden = None
        if "hidden" in body:
            if version < 2:
                raise SchemaError(f"field 'hidden' in a schema {version} record (hidden states are schema 2)")
            hidden = _unpack_array(body["hidden"], "hidden")
            _check_hidden(hidden, arrays["output_ids"].shape[0])
        t, p, k, seed = body["sampling"]
        source = body.get("source", "decode")
        if source not in SOURCES:
            raise SchemaError(f"body field 'source' is {repr(source)[:64]}, expected one of {SOURCES}")
        target_format = body.get("target_format")
        if target_format is not None and not (isinstance(target_format, str) and 0 < len(target_format) <= 64):
            raise SchemaError(f"body field 'target_format' is {repr(target_format)[:64]}, expected a format name "
                              f"(e.g. 'F16') of 1-64 characters")
        sample = VerifiedSample(
            request_id=body["request_id"],
            workload=workload,
            adapter_version=int(body["adapter_version"]),
            pair=PairFingerprint(*body["pair"]),
            sampling=SamplingSettings(temperature=t, top_p=p, top_k=k, seed=seed),
            started_at=body["started_at"],
            finished_at=body["finished_at"],
            record_id=record_id,
            schema_version=version,
            source=source,
            hidden=hidden,
            target_format=target_format,
            **arrays,
        )
    except SchemaError:
        raise
    except Exception as e:  # noqa: BLE001
        raise SchemaError(f"body field missing or malformed: {type(e).__name__}: {e}") from e
    return sample
