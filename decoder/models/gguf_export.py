"""GGUF files for a llama.cpp draft: the derived draft's blocks, and its LoRA adapters; and a
target's weights requantised (:func:`requantised_gguf`, for measuring what a weight format does to
the cost of a verification).

The torch derived draft (:func:`decoder.models.loading.derive_draft`) is the target's first k decoder
layers with the target's embeddings, final norm and LM head. :func:`derived_draft_gguf` writes
the same model as a GGUF file llama.cpp loads: the selected ``blk.N.*`` tensors of the target's
GGUF, renumbered, copied byte for byte (quantised types unchanged), with every non-block tensor
and all metadata. :func:`lora_to_gguf` converts a peft LoRA adapter trained on the torch draft
into a llama.cpp LoRA adapter GGUF for that file, following llama.cpp's
``convert_lora_to_gguf.py`` (metadata keys, tensor names ``<base>.lora_a`` / ``.lora_b``) and
``convert_hf_to_gguf.py`` (HF -> GGUF tensor names and the llama q/k row permutation).

Both writers go to a temporary file next to the destination and ``os.replace`` it into place,
so a reader never sees a partial file and concurrent callers are safe (the last rename wins and
every writer writes the same bytes).

Measured on 2 shared CPU cores with SmolLM2-135M Q4_1 (``tests/decoder/test_gguf_export.py``):
writing the 4-block derived GGUF (40.7 MB) takes 3.0-3.7 s, most of it GGUFReader parsing the
49k-token vocabulary and merges; a cached one returns in milliseconds. The first LoRA conversion
against a base takes 2.2-2.9 s for the same reason (the base's shapes and head counts are then
cached in-process, and later conversions take milliseconds); a :func:`lora_gguf_cached` hit
hashes the adapter: 8 ms for a rank-16 all-linear adapter of the 4-layer draft (2.6 MB).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import operator
import os
import re
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Bumped when the bytes lora_to_gguf writes for the same inputs change (invalidates the cache).
LORA_FORMAT_VERSION = 1

# HF module (parent, name) of a Llama-style decoder layer -> GGUF tensor base name
# (convert_hf_to_gguf.py / gguf-py tensor_mapping.py: MODEL_TENSOR.ATTN_Q -> "blk.{bid}.attn_q" ...).
HF_TO_GGUF = {
    ("self_attn", "q_proj"): "attn_q",
    ("self_attn", "k_proj"): "attn_k",
    ("self_attn", "v_proj"): "attn_v",
    ("self_attn", "o_proj"): "attn_output",
    ("mlp", "gate_proj"): "ffn_gate",
    ("mlp", "up_proj"): "ffn_up",
    ("mlp", "down_proj"): "ffn_down",
}

# Architectures whose HF -> GGUF converter permutes the rows of q_proj / k_proj
# (LlamaModel.modify_tensors in convert_hf_to_gguf.py). Only architectures whose row layout has
# been checked against llama.cpp are listed; others are refused rather than guessed.
_QK_PERMUTED = {"llama": True}

_LORA_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)\.lora_(A|B)\.weight$"
)
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


# ---- helpers --------------------------------------------------------------------------------


def file_digest16(path: Path) -> str:
    """First 16 hex of sha256(file size, first 16 MiB): the cheap file identity
    :func:`decoder.models.loading.resolve_model_dir` keys its cache by."""
    h = hashlib.sha256(f"{Path(path).stat().st_size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 24))
    return h.hexdigest()[:16]


def layer_spec(layers: Sequence[int]) -> str:
    """Compact, order-preserving spec of a layer list: ``[0, 1, 2, 3, 26, 27]`` -> ``"0-3,26-27"``.

    Runs of consecutive ascending indices become ``a-b``; a non-ascending list keeps its order
    (``[3, 1]`` -> ``"3,1"``), since it is a different file (blocks renumbered in list order).
    """
    parts: list[str] = []
    i = 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        parts.append(f"{layers[i]}-{layers[j]}" if j > i else f"{layers[i]}")
        i = j + 1
    return ",".join(parts)


def _check_layers(layers: Any, n_blocks: int | None, src: Path) -> list[int]:
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise ValueError(f"layers={layers!r}: pass a list of block indices, e.g. [0, 1, 2, 3]")
    out: list[int] = []
    for x in layers:
        if isinstance(x, bool):
            raise ValueError(f"layers={list(layers)!r}: {x!r} is not a block index")
        try:
            out.append(operator.index(x))
        except TypeError:
            raise ValueError(f"layers={list(layers)!r}: {x!r} is not an integer block index") from None
    if not out:
        raise ValueError("layers=[]: select at least one block, e.g. [0, 1, 2, 3]")
    neg = [i for i in out if i < 0]
    if neg:
        raise ValueError(f"layers={out!r}: {neg} are negative; block indices start at 0")
    dup = sorted({i for i in out if out.count(i) > 1})
    if dup:
        raise ValueError(f"layers={out!r}: {dup} selected more than once")
    if n_blocks is not None:
        bad = [i for i in out if i >= n_blocks]
        if bad:
            raise ValueError(f"layers={out!r}: {bad} outside 0..{n_blocks - 1} ({src.name} has {n_blocks} blocks)")
    return out


def _field(reader, key: str):
    f = reader.get_field(key)
    return None if f is None else f.contents()


def _copy_value(field) -> tuple[Any, Any, Any]:
    """(value, type, sub_type) of a GGUFReader field, ready for ``GGUFWriter.add_key_value``.

    Strings are passed as their raw bytes (GGUFWriter writes bytes as they are), so tokens that
    are not valid UTF-8 survive the copy unchanged.
    """
    from gguf import GGUFValueType

    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if len(field.types) != 2 or sub == GGUFValueType.ARRAY:
            raise ValueError(f"metadata {field.name!r}: nested arrays are not supported by this copier")
        if not len(field.data):
            raise ValueError(f"metadata {field.name!r}: an empty array, which GGUFWriter cannot write")
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data], main, sub
        return field.contents(), main, sub
    if main == GGUFValueType.STRING:
        return bytes(field.parts[-1]), main, None
    return field.contents(), main, None


def _tmp_path(out: Path) -> Path:
    """A new empty file beside ``out``, created with mode 0o666 less the umask (the mode the
    cached file keeps after ``os.replace``; ``mkstemp``'s 0o600 made the shared cache unreadable
    to any other user)."""
    for _ in range(100):
        tmp = out.parent / f".{out.name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise FileExistsError(f"no free temporary name beside {out}")


@contextlib.contextmanager
def _atomic_writer(out: Path, arch: str, **kw):
    """A ``gguf.GGUFWriter`` on a temp file beside ``out``, renamed onto ``out`` when the block
    ends (closed and deleted instead if it raises): concurrent callers never see a partial file."""
    import gguf

    tmp = _tmp_path(out)
    writer = None
    try:
        writer = gguf.GGUFWriter(tmp, arch, **kw)
        yield writer
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
        raise


# ---- derived draft ---------------------------------------------------------------------------


def derived_draft_gguf(src: Path, layers: list[int], cache_dir: Path | None = None) -> Path:
    """A GGUF of the derived draft: the blocks ``layers`` of the model in ``src``, renumbered.

    The file holds ``blk.{layers[n]}.*`` of ``src`` renamed ``blk.{n}.*`` for n = 0..L-1 (in the
    order given; :func:`decoder.models.loading.derive_draft` uses sorted indices), every non-block tensor
    (``token_embd``, ``output_norm``, ``output`` when present, ``rope_freqs``...), and all of
    ``src``'s metadata except ``{arch}.block_count``, set to L. Per-layer metadata arrays
    (``{arch}.*`` arrays of length block_count, e.g. per-layer head counts) are cut to the
    selected layers. Tensor data are copied byte for byte with their types (Q4_1 stays Q4_1).

    Written once: ``cache_dir`` (default ``decoder.models.packaged.cache_root() / "gguf"``) /
    ``{src.stem}-{digest16}-layers-{spec}.gguf``, where digest16 is :func:`file_digest16` of
    ``src`` and spec is :func:`layer_spec` of ``layers`` (e.g. ``"0-3"``). Later calls return
    the cached file (of a split ``src``, with its offset adapter beside it; a cached split draft
    whose adapter is gone is written again). Writes go to a temporary file in that directory, then ``os.replace``.

    Caveat: llama.cpp derives some per-layer behaviour from the block index itself (e.g. gemma3's
    sliding-window pattern, every 6th layer global); a selection that is not a prefix of the
    layers then changes those layers' behaviour. A prefix (``[0..k-1]``) is always faithful.

    Args:
        src: the source GGUF (e.g. ``decoder.models.packaged.packaged_gguf("smollm2-135m")``).
        layers: block indices of ``src``, non-empty, unique, each in ``0..block_count-1``.
        cache_dir: directory of the cached files (created if missing).

    Returns:
        Path of the derived GGUF (SmolLM2-135M, blocks 0-3: 40.7 MB, of which 30 MB are the
        Q8_0 token embedding, also the tied output head).

    Raises:
        ValueError: ``layers`` empty, out of range, repeated or not integers (naming the value);
            ``src`` has no ``{arch}.block_count``; metadata this copier cannot write.
        OSError: ``src`` unreadable or the cache directory not writable.
    """
    import gguf

    src = Path(src)
    if cache_dir is None:
        from decoder.models.packaged import cache_root

        cache_dir = cache_root() / "gguf"
    cache_dir = Path(cache_dir)
    sel = _check_layers(layers, None, src)
    out = cache_dir / f"{src.stem}-{file_digest16(src)}-layers-{layer_spec(sel)}.gguf"
    if out.is_file():  # only ever written for in-range layers of this very source
        if (out.parent / offset_lora_name(out)).is_file() or _field(gguf.GGUFReader(out, "r"), SPLIT_KEY) is None:
            return out
        # a split draft whose offset adapter was removed: both are written again
    reader = gguf.GGUFReader(src, "r")
    arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
    bc_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    n_blocks = _field(reader, bc_key)
    if not isinstance(n_blocks, int):
        raise ValueError(f"{src}: no {bc_key!r} in its metadata; is it a decoder model GGUF?")
    _check_layers(sel, n_blocks, src)
    cache_dir.mkdir(parents=True, exist_ok=True)

    new_of_old = {old: new for new, old in enumerate(sel)}
    split = _field(reader, SPLIT_KEY)  # a split Q4_1 source: the draft needs the offsets of its blocks
    derived_id = f"{_field(reader, SPLIT_ID_KEY)}-layers-{layer_spec(sel)}" if split else None
    lora_name = _derived_offset_lora(src, split, new_of_old, out, arch, derived_id) if split else None
    renamed = {SPLIT_KEY: lora_name.encode() if split else None, SPLIT_ID_KEY: derived_id.encode() if split else None,
               bc_key: len(sel)}
    with _atomic_writer(out, arch, endianess=reader.endianess) as writer:
        writer.data_alignment = reader.alignment
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue  # the writer adds the architecture; GGUF.* are the reader's header fields
            value, vtype, sub = _copy_value(field)
            if field.name in renamed:
                value = renamed[field.name]
            elif (field.name.startswith(f"{arch}.") and vtype == gguf.GGUFValueType.ARRAY
                  and sub != gguf.GGUFValueType.STRING and len(value) == n_blocks and n_blocks > 1):
                value = [value[i] for i in sel]  # per-layer hyperparameters
            writer.add_key_value(field.name, value, vtype, sub_type=sub)
        _write_tensors(writer, _selected_tensors(reader, new_of_old), reader.endianess)
    return out


def _selected_tensors(reader, new_of_old: dict[int, int]) -> list[tuple[str, Any]]:
    """(name in the derived file, reader tensor): every non-block tensor, then the selected blocks
    renumbered ``blk.{new}.*`` in their new order."""
    plain, blocks = [], [[] for _ in new_of_old]
    for t in reader.tensors:
        m = _BLOCK.match(t.name)
        if m is None:
            plain.append((t.name, t))
        elif int(m.group(1)) in new_of_old:
            new = new_of_old[int(m.group(1))]
            blocks[new].append((f"blk.{new}.{m.group(2)}", t))
    return plain + [x for blk in blocks for x in blk]


def _write_tensors(writer, tensors: list[tuple[str, Any]], endianess) -> None:
    """The header, the metadata already added, the tensor infos and the tensors' bytes, as read."""
    for name, t in tensors:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in tensors:
        writer.write_tensor_data(t.data, tensor_endianess=endianess)


# ---- requantised weights ---------------------------------------------------------------------


def weight_formats() -> dict[str, int]:
    """llama.cpp's file types by name (``"BF16"`` -> ``LLAMA_FTYPE_MOSTLY_BF16``), what
    :func:`requantised_gguf` takes. Raises EngineError without llama-cpp-python."""
    from decoder.engines.llamacpp_lib import bindings

    ll = bindings()
    return {k.removeprefix("LLAMA_FTYPE_MOSTLY_"): getattr(ll, k) for k in sorted(dir(ll))
            if k.startswith("LLAMA_FTYPE_MOSTLY_")}


def requantised_gguf(src: Path, fmt: str, cache_dir: Path | None = None) -> Path:
    """``src`` with its weights requantised to ``fmt`` by llama.cpp's own quantiser
    (``llama_model_quantize``, ``allow_requantize``), written once.

    ``fmt`` is a llama.cpp file type (``LLAMA_FTYPE_MOSTLY_<fmt>``: Q4_0, IQ4_NL, Q8_0, BF16, F16,
    ...); llama.cpp chooses per-tensor types as its ``llama-quantize`` does (norms stay F32). The
    result is a different model from ``src`` unless the format holds ``src``'s values exactly
    (requantising Q4_1 to Q4_0 loses more; BF16 rounds a Q4_1 weight d * q + m to 8 significant
    bits): ``bench/verify_cost_bench.py --formats`` uses it to measure how the weight format
    moves the cost of a verification of n rows (bench/RESULTS.md), and a ``name@FORMAT`` model
    reference (:func:`decoder.models.loading.packaged_target`) to serve a built-in model so.

    Cached as ``cache_dir`` (default ``decoder.models.packaged.cache_root() / "requant"``) /
    ``{src.stem}-{digest16}-{FMT}.gguf`` (:func:`file_digest16`), written to a temporary file and
    renamed into place.

    Raises:
        ValueError: ``fmt`` is not a llama.cpp file type (the message lists the known ones).
        EngineError: llama-cpp-python is not installed.
        RuntimeError: llama_model_quantize failed (its return code is in the message).
    """
    import ctypes

    from decoder.engines.llamacpp_lib import bindings
    from decoder.models.packaged import cache_root

    src = Path(src)
    ll = bindings()
    name = str(fmt).strip().upper()
    formats = weight_formats()
    ftype = formats.get(name)
    if ftype is None:
        raise ValueError(f"{fmt!r} is not a llama.cpp weight format; use one of {', '.join(formats)}")
    out = Path(cache_dir or cache_root() / "requant") / f"{src.stem}-{file_digest16(src)}-{name}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _drop_stale_tmps(out)
    tmp = _tmp_path(out)
    try:
        params = ll.llama_model_quantize_default_params()
        params.ftype = ftype
        params.allow_requantize = True
        params.nthread = os.cpu_count() or 1
        rc = ll.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({src.name} -> {name}) returned {rc}: llama.cpp cannot write this "
                               f"model in {name} (some formats need an importance matrix, or rows whose length divides "
                               f"their block); pick another format (models.format: packaged, Q8_0, F16, ...)")
        _flush(tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


STALE_TMP_S = 3600.0  # a temporary requantised file older than this is a killed start's leftover


def _drop_stale_tmps(out: Path) -> None:
    """Delete the temporary files of ``out`` (:func:`_tmp_path`) older than :data:`STALE_TMP_S`
    seconds: a start killed while writing leaves one (up to hundreds of MB) that nothing else
    removes; a younger one may be another process's write under way."""
    now = time.time()
    for tmp in out.parent.glob(f".{out.name}.*.tmp"):
        try:
            if now - tmp.stat().st_mtime > STALE_TMP_S:
                tmp.unlink()
        except OSError:  # gone meanwhile, or not ours to remove
            pass


def _flush(path: Path) -> None:
    """``path``'s bytes on disk (fsync) before it is renamed into place: a crash never leaves a
    renamed file whose data was not written."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- Q4_1 split into Q4_0 blocks and an offset adapter ------------------------------------------

# Metadata key of a split file: the file name (same directory) of the offset adapter it needs.
# LlamaCppEngine reads it and applies that adapter under every forward; without it the file's
# weights are d * (q - 8) only, a broken model (KL 15 nats from the packaged one).
SPLIT_KEY = "draftd.q4_1_split.offset_lora"
# In a split model and its offset adapter alike: the pair's identity (source digest, format, layers),
# so an adapter of another model, or of another layer selection, is refused at load.
SPLIT_ID_KEY = "draftd.q4_1_split.id"
SPLIT_FORMAT = "Q4_1S"
SPLIT_FORMAT_VERSION = 3  # in the file name: bumped when the bytes written for the same source change
_Q4_1_BYTES, _Q4_0_BYTES = 20, 18  # per 32-weight block: (d f16, m f16, 16 nibble bytes) / (d f16, 16 nibble bytes)


def offset_lora_name(model_file: Path) -> str:
    """The offset adapter's file name beside a split ``model_file``."""
    return f"{Path(model_file).stem}.offset-lora.gguf"


def q4_1_split(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One Q4_1 tensor's bytes as Q4_0 bytes plus the per-block offset, exactly.

    A Q4_1 block of 32 weights holds (d, m, q[32]) with w = d q + m, q in 0..15 (ggml-common.h
    ``block_q4_1``); a Q4_0 block holds (d, q[32]) with w = d (q - 8) (``block_q4_0``), the same
    nibble layout. So w = d (q - 8) + (m + 8 d): the Q4_0 block keeps d and the nibbles byte for
    byte, and the offset o = m + 8 d (exact in float32: d and m are float16) is constant over the
    block, so W x = W_q4_0 x + O (A x) with A the (in / 32, in) matrix summing each block of x,
    O the (out, in / 32) offsets: a LoRA of rank in / 32 that llama.cpp adds to the matmul.

    Args:
        data: uint8 (out, in / 32 * 20), GGUFReader's rows of a Q4_1 tensor.

    Returns:
        (q4_0 bytes uint8 (out, in / 32 * 18), lora_a float32 (in / 32, in) of ones per block,
        lora_b float32 (out, in / 32) = m + 8 d).

    Raises:
        ValueError: ``data`` is not whole Q4_1 blocks.
    """
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] % _Q4_1_BYTES:
        raise ValueError(f"Q4_1 rows must be uint8 (out, n * {_Q4_1_BYTES}) bytes, got {data.dtype} {data.shape}")
    out, nb = data.shape[0], data.shape[1] // _Q4_1_BYTES
    blocks = data.reshape(out, nb, _Q4_1_BYTES)
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
    m = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
    q4_0 = np.concatenate([blocks[:, :, 0:2], blocks[:, :, 4:]], axis=2).reshape(out, nb * _Q4_0_BYTES)
    lora_a = np.kron(np.eye(nb, dtype=np.float32), np.ones((1, 32), np.float32))
    return np.ascontiguousarray(q4_0), lora_a, (m + np.float32(8) * d).astype(np.float32)


def ones_q8_0(a: np.ndarray) -> np.ndarray:
    """A 0/1 matrix (rows, in) whose ones fill whole 32-blocks, as Q8_0 bytes (rows, in / 32 * 34),
    exactly: a block of ones is d = 1.0 with q = 1, a block of zeros d = 0 with q = 0."""
    rows, n = a.shape
    blk = a.reshape(rows, n // 32, 32)
    out = np.zeros((rows, n // 32, 34), np.uint8)
    d = np.where(blk.max(axis=2) > 0, np.float16(1.0), np.float16(0.0)).astype(np.float16)
    out[:, :, 0:2] = d.view(np.uint8).reshape(rows, n // 32, 2)
    out[:, :, 2:] = blk.astype(np.int8).view(np.uint8)
    return out.reshape(rows, -1)


def offset_lora_tensors(name: str, lora_a: np.ndarray, lora_b: np.ndarray) -> list[tuple[str, np.ndarray, Any]]:
    """What the offset adapter stores for one weight (name, data, GGML type), chosen so that a
    verification of n rows gives each row bit for bit the logits a one-row step gives (greedy
    speculation then emits what plain decoding does, as on the packaged Q4_1 file):

    - ``lora_a`` in Q8_0 (exact: :func:`ones_q8_0`): llama.cpp quantises the activations to Q8_0
      for it, so A x is the *quantised* block sums d_x Σ q_x, as its Q4_1 kernel uses them, and
      with one nonzero block per row every kernel computes it exactly;
    - ``lora_b`` in float16 (the offsets m + 8 d rounded to float16; llama.cpp's Q4_1 kernel rounds
      the block sums to float16 the same way), with one zero column more (rank in / 32 + 1): at a
      rank that is a multiple of 16, llama.cpp's tinyBLAS took the matmul from 9 rows on and summed
      in another order than the one-row kernel, and through the next layer's 8-bit activations that
      rounding moved logits by up to 0.98.

    Measured (one thread and two): float32 A and B differed from the one-row logits by 0.98 at
    every n; these by 0.0 at n = 2..16."""
    import gguf

    a = np.concatenate([lora_a, np.zeros((1, lora_a.shape[1]), np.float32)])
    b = np.concatenate([lora_b, np.zeros((lora_b.shape[0], 1), np.float32)], axis=1)
    return [(name + ".lora_a", ones_q8_0(a), gguf.GGMLQuantizationType.Q8_0),
            (name + ".lora_b", b.astype(np.float16), gguf.GGMLQuantizationType.F16)]


def _write_offset_lora(out: Path, arch: str, tensors: list[tuple[str, np.ndarray, Any]], split_id: str) -> None:
    """An adapter GGUF as llama.cpp's convert_lora_to_gguf.py writes one, with alpha 0 (llama.cpp
    then scales B A x by the user scale alone, 1.0: ``llama_adapter_lora_weight::get_scale``), and
    :data:`SPLIT_ID_KEY` = ``split_id``, the model's."""
    import gguf

    with _atomic_writer(out, arch) as writer:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 0.0)
        writer.add_string(SPLIT_ID_KEY, split_id)
        writer.add_name("q4_1-offsets")
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for name, data, typ in tensors:
            if typ == gguf.GGMLQuantizationType.Q8_0:
                writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=typ)
            else:
                writer.add_tensor(name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()


def q4_1_split_gguf(src: Path, cache_dir: Path | None = None) -> Path:
    """``src`` with every Q4_1 tensor split into Q4_0 blocks and an offset adapter (see
    :func:`q4_1_split`): the Q4_1 weights (their per-block offsets rounded to float16), served by
    llama.cpp's repacked Q4_0 kernels (a GEMM over 4 rows on x86, where Q4_1 has only a dot
    product per row) plus a LoRA of rank in / 32 + 1 (:func:`offset_lora_tensors`, whose types make
    a verification's rows bit-identical to one-row steps).

    Not bit-identical to ``src``: llama.cpp's Q4_1 and Q4_0 kernels accumulate in other orders and
    the offsets meet the activations in float16; measured on the packaged SmolLM2-135M, mean KL
    about 0.005 nats from the packaged file, the same argmax at 95-96 % of teacher-forced
    positions (BF16 of the same weights: 0.0043, 96.6 %), bench/RESULTS.md. Other tensors are
    copied byte for byte, all metadata kept, and :data:`SPLIT_KEY` names the adapter, which
    :class:`decoder.engines.llamacpp.LlamaCppEngine` applies under every forward.

    Written once: ``cache_dir`` (default ``decoder.models.packaged.cache_root() / "requant"``) /
    ``{src.stem}-{digest16}-Q4_1S-v{SPLIT_FORMAT_VERSION}.gguf`` and its ``.offset-lora.gguf`` beside it (the adapter
    first, so a model file never exists without its adapter).

    Raises:
        ValueError: ``src`` has no Q4_1 tensor (nothing to split), or metadata this copier cannot write.
        OSError: ``src`` unreadable or the cache directory not writable.
    """
    import gguf

    from decoder.models.packaged import cache_root

    src = Path(src)
    out = (Path(cache_dir or cache_root() / "requant")
           / f"{src.stem}-{file_digest16(src)}-{SPLIT_FORMAT}-v{SPLIT_FORMAT_VERSION}.gguf")
    lora = out.parent / offset_lora_name(out)
    if out.is_file() and lora.is_file():
        return out
    reader = gguf.GGUFReader(src, "r")
    arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
    split_id = f"{file_digest16(src)}-{SPLIT_FORMAT}-v{SPLIT_FORMAT_VERSION}"
    tensors, offsets = [], []
    for t in reader.tensors:
        # the decoder blocks' matmuls only: token_embd is a row lookup (and llama.cpp wants an
        # embedding adapter's A and B the other way round), the output head is left as it is
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_1 and _BLOCK.match(t.name) and t.name.endswith(".weight"):
            q, a, b = q4_1_split(np.asarray(t.data))
            tensors.append((t.name, q, gguf.GGMLQuantizationType.Q4_0))
            offsets += offset_lora_tensors(t.name, a, b)
        else:
            tensors.append((t.name, t.data, t.tensor_type))
    if not offsets:
        raise ValueError(f"{src} has no Q4_1 matmul in its decoder blocks: nothing to split (its types: "
                         f"{sorted({t.tensor_type.name for t in reader.tensors})})")
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_offset_lora(lora, arch, offsets, split_id)
    with _atomic_writer(out, arch, endianess=reader.endianess) as writer:
        writer.data_alignment = reader.alignment
        for field in reader.fields.values():
            if (field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.")
                    or field.name in (SPLIT_KEY, SPLIT_ID_KEY)):
                continue
            value, vtype, sub = _copy_value(field)
            writer.add_key_value(field.name, value, vtype, sub_type=sub)
        writer.add_string(SPLIT_KEY, lora.name)
        writer.add_string(SPLIT_ID_KEY, split_id)
        for name, data, typ in tensors:
            writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, typ)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, data, _ in tensors:
            writer.write_tensor_data(np.ascontiguousarray(data), tensor_endianess=reader.endianess)
    return out


def _derived_offset_lora(src: Path, split_name: str, new_of_old: dict[int, int], out_model: Path, arch: str,
                         split_id: str) -> str:
    """The offset adapter of a derived draft of a split ``src``: the source adapter's tensors of
    the kept blocks, renumbered, under the derived model's ``split_id``. Returns its file name
    (beside ``out_model``)."""
    import gguf

    lora_src = src.parent / split_name
    if not lora_src.is_file():
        raise ValueError(f"{src} is a split Q4_1 file whose offset adapter {lora_src} is missing; "
                         f"remove {src} so it is written again")
    r = gguf.GGUFReader(lora_src, "r")
    kept = []
    for t in r.tensors:
        m = _BLOCK.match(t.name)
        if m and int(m.group(1)) in new_of_old:
            kept.append((f"blk.{new_of_old[int(m.group(1))]}.{m.group(2)}", np.array(t.data), t.tensor_type))
    name = offset_lora_name(out_model)
    _write_offset_lora(out_model.parent / name, arch, kept, split_id)
    return name


# ---- LoRA adapters ---------------------------------------------------------------------------


def _permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row permutation convert_hf_to_gguf.py's ``LlamaModel.permute`` applies to q/k weights.

    ``w`` (out, ...) with out = n_head * head_dim: rows of each head go from HF's
    [first half | second half] rotary layout to GGUF's interleaved pairs, i.e.
    ``w.reshape(n_head, 2, head_dim // 2, ...).swapaxes(1, 2).reshape(w.shape)``.
    """
    if w.shape[0] % (2 * n_head):
        raise ValueError(f"cannot permute {w.shape[0]} rows into {n_head} heads of even size")
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _pattern_value(patterns: dict, module: str, default):
    """peft's ``get_pattern_key`` lookup (rank_pattern / alpha_pattern) for a module path."""
    for key in patterns or {}:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


@functools.lru_cache(maxsize=8)
def _base_info(path: str, size: int, mtime_ns: int) -> tuple[str, int, int, int, dict[str, tuple[int, ...]]]:
    """(arch, block_count, head_count, head_count_kv, {tensor: ggml ne}) of a model GGUF.

    Cached per (path, size, mtime): GGUFReader parses the whole vocabulary (about 2 s for
    SmolLM2's 49k tokens and merges), which would otherwise dominate every adapter conversion.
    """
    import gguf

    del size, mtime_ns  # cache key only
    reader = gguf.GGUFReader(path, "r")
    arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
    if arch not in _QK_PERMUTED:
        raise ValueError(
            f"{path}: architecture {arch!r} is not supported (its HF -> GGUF q/k row layout is not "
            f"checked here); supported: {sorted(_QK_PERMUTED)}")
    n_blocks = _field(reader, gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch))
    n_head = _field(reader, gguf.Keys.Attention.HEAD_COUNT.format(arch=arch))
    n_head_kv = _field(reader, gguf.Keys.Attention.HEAD_COUNT_KV.format(arch=arch))
    if n_head_kv is None:
        n_head_kv = n_head
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (n_blocks, n_head, n_head_kv)):
        raise ValueError(
            f"{path}: need positive scalar {arch}.block_count, .attention.head_count and .attention.head_count_kv "
            f"in its metadata (got {n_blocks!r}, {n_head!r}, {n_head_kv!r})")
    ne = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}  # ggml order: (in, out)
    return arch, n_blocks, n_head, n_head_kv, ne


def _check_lora_config(cfg: dict, where: Path) -> None:
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{where}: peft_type={cfg.get('peft_type')!r}; only LORA adapters convert")
    if cfg.get("use_dora"):
        raise ValueError(f"{where}: use_dora=True; DoRA's magnitude vector has no llama.cpp LoRA equivalent")
    if cfg.get("modules_to_save"):
        raise ValueError(
            f"{where}: modules_to_save={cfg['modules_to_save']!r}; full-module copies are not LoRA tensors "
            f"(llama.cpp adapters hold lora_a/lora_b only)")
    refused = {
        "lora_bias": "a bias on lora_B", "use_qalora": "QA-LoRA", "use_bdlora": "block-diagonal LoRA",
        "arrow_config": "Arrow routing", "kasa_config": "KaSA", "velora_config": "VeLoRA",
        "monteclora_config": "MonteCLoRA", "alora_invocation_tokens": "activated LoRA",
        "trainable_token_indices": "trainable tokens", "target_parameters": "LoRA on parameters",
        "layer_replication": "layer replication",
    }
    for key, what in refused.items():
        if cfg.get(key):
            raise ValueError(f"{where}: {key}={cfg[key]!r} ({what}) is not supported by llama.cpp LoRA adapters")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={cfg['bias']!r}; trained base biases are not LoRA tensors (use bias='none')")
    init = cfg.get("init_lora_weights", True)
    if not (isinstance(init, bool) or init == "gaussian"):
        raise ValueError(
            f"{where}: init_lora_weights={init!r} rewrites the base weights, which the GGUF base does not have")
    alpha = cfg.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"{where}: lora_alpha={alpha!r}; need a finite number > 0 (llama.cpp reads 0 as scale 1)")
    if cfg.get("use_rslora") and (cfg.get("rank_pattern") or cfg.get("alpha_pattern")):
        raise ValueError(f"{where}: use_rslora with rank_pattern/alpha_pattern (peft refuses this too)")


def lora_to_gguf(adapter_dir: Path, out: Path, base_gguf: Path) -> Path:
    """Convert a peft LoRA adapter of the torch derived draft into a llama.cpp LoRA GGUF.

    Input: peft's ``save_pretrained`` layout in ``adapter_dir`` (``adapter_config.json`` +
    ``adapter_model.safetensors``), tensors ``base_model.model.model.layers.{i}.{self_attn|mlp}.
    {q,k,v,o,gate,up,down}_proj.lora_{A,B}.weight`` with lora_A (r, in) and lora_B (out, r).
    Draft layer i is block i of ``base_gguf`` (the :func:`derived_draft_gguf` file).

    Output, as llama.cpp's ``convert_lora_to_gguf.py`` writes it: ``general.type = "adapter"``,
    ``adapter.type = "lora"``, ``adapter.lora.alpha`` (float32) = the config's ``lora_alpha``,
    ``general.architecture`` of ``base_gguf``; for each module the F32 tensors
    ``blk.{i}.{attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down}.weight.lora_a`` (numpy
    shape (r, in), ggml ne = [in, r]) and ``.lora_b`` ((out, r), ne = [r, out]).
    llama.cpp computes ``W x + s * B (A x)`` with ``s = lora_scale * alpha / r`` (r = lora_b's
    ne[0]), peft's LoRA ``W x + (alpha / r) * B (A x)``; where peft's scale differs (rsLoRA:
    alpha / sqrt(r); an ``alpha_pattern`` entry), the ratio is folded into lora_b so the two agree.

    q/k rows: for ``llama``, convert_hf_to_gguf.py stores q_proj / k_proj with the rows of each
    head permuted (``LlamaModel.permute``: n_head for q, n_head_kv for k, read here from
    ``base_gguf``'s ``{arch}.attention.head_count`` / ``head_count_kv``); lora_B of q and k gets
    the same row permutation (lora_A, acting on the input, is unchanged), as
    convert_lora_to_gguf.py does through its ``LoraTorchTensor``. Other architectures are refused
    until their layout is checked. ``fan_in_fan_out`` needs nothing: it only changes how peft
    stores the *base* weight; lora_A / lora_B are (r, in) / (out, r) either way, and every shape
    is checked against ``base_gguf``'s tensors.

    Args:
        adapter_dir: the peft adapter directory.
        out: the GGUF file to write (its directory is created; written atomically).
        base_gguf: the llama.cpp model the adapter will be applied to.

    Returns:
        ``out``.

    Raises:
        ValueError: naming the problem: missing files; not LoRA; DoRA, modules_to_save, lora bias
            or another variant llama.cpp cannot run; lora_alpha <= 0; a tensor that is not a
            lora_A/lora_B of a known module; a layer >= the base's block count; a lora_A without
            its lora_B; shapes that do not fit the base tensor; non-finite weights; an
            unsupported architecture.
    """
    adapter_dir, out, base_gguf = Path(adapter_dir), Path(out), Path(base_gguf)
    cfg, tensors, w_path = _read_peft_lora(adapter_dir)
    st = base_gguf.stat()
    arch, n_blocks, n_head, n_head_kv, base_ne = _base_info(str(base_gguf), st.st_size, st.st_mtime_ns)
    pairs = _lora_pairs(tensors, w_path, base_gguf, n_blocks)
    alpha = float(cfg["lora_alpha"])
    order = list(HF_TO_GGUF.values())
    written: list[tuple[str, np.ndarray]] = []
    for (layer, gname) in sorted(pairs, key=lambda k: (k[0], order.index(k[1]))):
        A, B = _lora_pair_for_llamacpp(pairs[(layer, gname)], f"blk.{layer}.{gname}.weight", gname, cfg, w_path,
                                       base_gguf, base_ne, arch, n_head, n_head_kv)
        written.append((f"blk.{layer}.{gname}.weight.lora_a", A))
        written.append((f"blk.{layer}.{gname}.weight.lora_b", B))
    _write_lora_gguf(out, arch, alpha, adapter_dir.name or "lora", written)
    return out


def _read_peft_lora(adapter_dir: Path) -> tuple[dict, dict, Path]:
    """(config, tensors by name, weights path) of a peft LoRA directory; ValueError naming what is wrong."""
    from safetensors.torch import load_file

    cfg_path, w_path = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise ValueError(f"{adapter_dir} lacks {p.name}; pass a peft save_pretrained directory")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise ValueError(f"{cfg_path} is not JSON: {e}") from e
    _check_lora_config(cfg, cfg_path)
    try:
        tensors = load_file(str(w_path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{w_path} is not a readable safetensors file: {e}") from e
    return cfg, tensors, w_path


def _lora_pairs(tensors: dict, w_path: Path, base_gguf: Path, n_blocks: int) -> dict[tuple[int, str], dict[str, Any]]:
    """{(layer, gguf module): {"hf": peft module name, "A": (r, in), "B": (out, r)}} (float32
    numpy), every name, layer, rank and value checked."""
    pairs: dict[tuple[int, str], dict[str, Any]] = {}
    for key, t in tensors.items():
        m = _LORA_KEY.match(key)
        if m is None or (m.group(2), m.group(3)) not in HF_TO_GGUF:
            known = ", ".join(f"{a}.{b}" for a, b in HF_TO_GGUF)
            raise ValueError(f"{w_path}: tensor {key!r} is not a lora_A/lora_B weight of a decoder layer's {known}")
        layer = int(m.group(1))
        if layer >= n_blocks:
            raise ValueError(
                f"{w_path}: tensor {key!r} targets layer {layer}, but {base_gguf.name} has {n_blocks} blocks "
                f"(0..{n_blocks - 1}); convert against the derived GGUF with the adapter's layer count")
        if t.dim() != 2:
            raise ValueError(f"{w_path}: tensor {key!r} has shape {tuple(t.shape)}, not a matrix")
        a = t.detach().to("cpu").float().numpy()
        if not np.isfinite(a).all():
            raise ValueError(f"{w_path}: tensor {key!r} has non-finite values")
        hf = f"model.layers.{layer}.{m.group(2)}.{m.group(3)}"
        pairs.setdefault((layer, HF_TO_GGUF[(m.group(2), m.group(3))]), {"hf": hf})[m.group(4)] = a
    if not pairs:
        raise ValueError(f"{w_path}: no LoRA tensors")
    return pairs


def _lora_pair_for_llamacpp(p: dict[str, Any], base: str, gname: str, cfg: dict, w_path: Path, base_gguf: Path,
                            base_ne: dict, arch: str, n_head: int, n_head_kv: int) -> tuple[np.ndarray, np.ndarray]:
    """One module's (lora_a, lora_b) as llama.cpp applies them to ``base``: shapes checked against
    the base tensor, peft's scale folded into lora_b where it is not alpha / r, q / k rows permuted
    as convert_hf_to_gguf.py permutes the base's."""
    if "A" not in p or "B" not in p:
        have, lack = ("A", "B") if "A" in p else ("B", "A")
        raise ValueError(f"{w_path}: {p['hf']} has lora_{have} but no lora_{lack}")
    A, B = p["A"], p["B"]
    ne = base_ne.get(base)
    if ne is None:
        raise ValueError(f"{w_path}: {p['hf']} maps to {base}, which {base_gguf.name} does not have")
    r = A.shape[0]
    if len(ne) != 2 or A.shape != (r, ne[0]) or B.shape != (ne[1], r):
        raise ValueError(
            f"{w_path}: {p['hf']} has lora_A {A.shape} and lora_B {B.shape}; {base} has ggml shape "
            f"{list(ne)} ([in, out]), so it needs ({r}, in) and (out, {r})")
    r_cfg = _pattern_value(cfg.get("rank_pattern"), p["hf"], cfg.get("r"))
    if r_cfg != r:
        raise ValueError(f"{w_path}: {p['hf']} has rank {r}, its config says r={r_cfg!r}")
    alpha = float(cfg["lora_alpha"])
    alpha_m = float(_pattern_value(cfg.get("alpha_pattern"), p["hf"], alpha))
    peft_scale = alpha_m / math.sqrt(r) if cfg.get("use_rslora") else alpha_m / r
    fold = peft_scale / (alpha / r)  # llama.cpp applies alpha / r
    if fold != 1.0:
        B = B * np.float32(fold)
    if _QK_PERMUTED[arch] and gname == "attn_q":
        B = _permute_rows(B, n_head)
    elif _QK_PERMUTED[arch] and gname == "attn_k":
        B = _permute_rows(B, n_head_kv)
    return np.ascontiguousarray(A, dtype=np.float32), np.ascontiguousarray(B, dtype=np.float32)


def _write_lora_gguf(out: Path, arch: str, alpha: float, name: str, written: list[tuple[str, np.ndarray]]) -> None:
    """The adapter GGUF as convert_lora_to_gguf.py writes it (atomically)."""
    import gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    with _atomic_writer(out, arch) as writer:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        writer.add_name(name)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for tname, arr in written:
            writer.add_tensor(tname, arr)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()


def adapter_sha256(adapter_dir: Path) -> str:
    """sha256 (hex) of ``adapter_config.json`` and ``adapter_model.safetensors``, each
    length-prefixed: the identity of one adapter version."""
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        p = Path(adapter_dir) / name
        if not p.is_file():
            raise ValueError(f"{adapter_dir} lacks {name}; pass a peft save_pretrained directory")
        h.update(f"{name}\0{p.stat().st_size}\0".encode())
        with open(p, "rb") as f:
            while b := f.read(1 << 22):
                h.update(b)
    return h.hexdigest()


def warm_lora_base(base_gguf: Path) -> None:
    """Parse ``base_gguf``'s shapes for :func:`lora_to_gguf` now (the in-process cache of
    ``_base_info``), so that a replica's first promoted adapter converts in milliseconds instead
    of the 2-3 s (10-20 s on a loaded 2-core host: docs/scaling.md, "the fault run") that parsing
    the base's vocabulary takes.

    Raises:
        ValueError: an architecture :func:`lora_to_gguf` does not convert for.
    """
    st = Path(base_gguf).stat()
    _base_info(str(base_gguf), st.st_size, st.st_mtime_ns)


def lora_gguf_cached(adapter_dir: Path, cache_dir: Path, base_gguf: Path) -> Path:
    """:func:`lora_to_gguf` once per adapter version and base: ``cache_dir /
    lora-{adapter16}-{base16}-v{LORA_FORMAT_VERSION}.gguf``.

    adapter16 is the first 16 hex of :func:`adapter_sha256` (config + weights), base16 the
    :func:`file_digest16` of ``base_gguf`` (the q/k permutation and the block count come from
    it, so another base is another file). A cached file is returned after hashing the adapter
    (8 ms for a rank-16 all-linear adapter of the 4-layer draft) and the base's first 16 MiB.

    Raises:
        ValueError: as :func:`lora_to_gguf`.
    """
    name = f"lora-{adapter_sha256(adapter_dir)[:16]}-{file_digest16(base_gguf)}-v{LORA_FORMAT_VERSION}.gguf"
    out = Path(cache_dir) / name
    if out.is_file():
        return out
    return lora_to_gguf(adapter_dir, out, base_gguf)


# ---- FR-Spec restricted-vocabulary draft -------------------------------------------------------

# Metadata of a restricted draft (restricted_draft_gguf); LlamaCppEngine reads them at load.
RESTRICTED_FULL_VOCAB_KEY = "draftd.restricted.full_vocab"  # uint32: the full vocabulary V
RESTRICTED_IDS_KEY = "draftd.restricted.ids_sha"  # str: sha256[:16] of the (V',) int64 id list's bytes
RESTRICTED_EMBD_TYPE_KEY = "draftd.restricted.input_embd_type"  # uint32: ggml type of the sidecar table
RESTRICTED_FORMAT_VERSION = 1  # in the file name: bumped when the bytes written for the same inputs change


def restricted_sidecars(model_file: Path) -> tuple[Path, Path]:
    """(ids file, input-embedding file) beside a restricted draft GGUF: ``{stem}.ids.npy``
    ((V',) int64, the full-vocabulary id of each row) and ``{stem}.input-embd.npy`` ((V, row
    bytes) uint8, the full ``token_embd`` of the draft it was cut from, in its ggml type)."""
    model_file = Path(model_file)
    return (model_file.with_name(model_file.stem + ".ids.npy"),
            model_file.with_name(model_file.stem + ".input-embd.npy"))


def ids_sha16(ids: np.ndarray) -> str:
    """First 16 hex of sha256 of ``ids`` as little-endian int64 bytes (the restricted file's key)."""
    return hashlib.sha256(np.ascontiguousarray(ids, dtype="<i8").tobytes()).hexdigest()[:16]


def restricted_draft_gguf(src: Path, ids, cache_dir: Path | None = None) -> Path:
    """A draft GGUF whose vocabulary is the FR-Spec restricted ids (``decoder.vocab``): its
    ``token_embd`` (and ``output`` when untied) hold only the rows ``ids`` of ``src``'s, in the
    order of ``ids``, so llama.cpp's LM head computes V' logits instead of V.

    llama.cpp's llama architecture creates ``token_embd`` and ``output`` with ``n_vocab`` rows, and
    n_vocab is the length of ``tokenizer.ggml.tokens``: the tokenizer arrays (tokens, token types,
    scores) are cut to ``ids`` too, and every ``tokenizer.ggml.*_token_id`` is renumbered to its
    row in ``ids`` (dropped when that token is not kept); merges and everything else are copied.
    The file's own vocabulary is not for tokenizing: the input of a row r's token is fed as an
    embedding (``llama_batch.embd``), looked up from the full table of ``src``, which is written
    beside the file (:func:`restricted_sidecars`) with the id list; :class:`decoder.engines.llamacpp.LlamaCppEngine`
    finds both through the metadata :data:`RESTRICTED_FULL_VOCAB_KEY` / :data:`RESTRICTED_IDS_KEY`
    and scatters row r's logit to id ``ids[r]`` (q = 0 elsewhere, as FR-Spec's mask).

    Blocks, norms and their types are copied byte for byte, so a LoRA adapter of ``src``'s blocks
    (:func:`lora_to_gguf`, which targets decoder layers only) applies unchanged. A split ``src``
    keeps its offset-adapter keys: write the file in ``src``'s directory (the default) so the
    adapter is found.

    Written once: ``cache_dir`` (default: ``src``'s directory) /
    ``{src.stem}-vocab{V'}-{ids_sha16}-r{RESTRICTED_FORMAT_VERSION}.gguf``, atomically.

    Args:
        src: a draft GGUF (:func:`derived_draft_gguf`), whose ``token_embd`` rows are whole blocks.
        ids: (V',) distinct token ids of ``src``'s vocabulary (a torch tensor, numpy array or list).

    Returns:
        the restricted GGUF's path.

    Raises:
        ValueError: ids empty, repeated or out of range; ``src`` without ``token_embd`` or a
            tokenizer token list.
    """
    import gguf

    src = Path(src)
    ids = _distinct_ids(ids)
    cache_dir = Path(cache_dir) if cache_dir is not None else src.parent
    sha = ids_sha16(ids)
    out = cache_dir / f"{src.stem}-vocab{ids.size}-{sha}-r{RESTRICTED_FORMAT_VERSION}.gguf"
    ids_file, embd_file = restricted_sidecars(out)
    if out.is_file() and ids_file.is_file() and embd_file.is_file():
        return out
    reader = gguf.GGUFReader(src, "r")
    arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
    tok_field = reader.get_field(gguf.Keys.Tokenizer.LIST)
    tensors = {t.name: t for t in reader.tensors}
    if tok_field is None or "token_embd.weight" not in tensors:
        raise ValueError(f"{src}: need tokenizer.ggml.tokens and token_embd.weight to restrict the vocabulary")
    n_vocab = len(tok_field.data)
    if ids.max() >= n_vocab:
        raise ValueError(f"restricted_draft_gguf: ids up to {int(ids.max())}, but {src.name} has {n_vocab} tokens")
    emb = tensors["token_embd.weight"]
    if emb.data.shape[0] != n_vocab:
        raise ValueError(f"{src}: token_embd has {emb.data.shape[0]} rows, the vocabulary {n_vocab}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    # sidecars first (the GGUF's presence is what the cache check trusts last)
    for path, arr in ((ids_file, ids), (embd_file, np.ascontiguousarray(emb.data))):
        _save_npy_atomic(path, arr)
    with _atomic_writer(out, arch, endianess=reader.endianess) as writer:
        writer.data_alignment = reader.alignment
        _copy_restricted_fields(reader, writer, arch, ids)
        writer.add_uint32(RESTRICTED_FULL_VOCAB_KEY, n_vocab)
        writer.add_string(RESTRICTED_IDS_KEY, sha)
        writer.add_uint32(RESTRICTED_EMBD_TYPE_KEY, int(emb.tensor_type))
        cut = []
        for name, t in tensors.items():
            if name in ("token_embd.weight", "output.weight") and t.data.shape[0] == n_vocab:
                cut.append((name, _Rows(t, ids)))
            else:
                cut.append((name, t))
        _write_tensors(writer, cut, reader.endianess)
    return out


def _distinct_ids(ids) -> np.ndarray:
    """``ids`` (a torch tensor, numpy array or list) as a flat int64 array of distinct
    non-negative token ids; else ValueError."""
    ids = np.asarray(ids.cpu().numpy() if hasattr(ids, "cpu") else ids, dtype=np.int64).reshape(-1)
    if ids.size == 0 or np.unique(ids).size != ids.size or ids.min() < 0:
        raise ValueError(f"restricted_draft_gguf: need distinct non-negative token ids (got {ids.size} ids, "
                         f"{ids.size - np.unique(ids).size} repeated)")
    return ids


def _save_npy_atomic(path: Path, arr: np.ndarray) -> None:
    """``np.save`` of ``arr`` to ``path`` through a temporary file renamed into place."""
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            np.save(f, arr)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _copy_restricted_fields(reader, writer, arch: str, ids: np.ndarray) -> None:
    """Every metadata field of ``reader`` into ``writer``, the vocabulary cut to ``ids``: the
    tokenizer arrays keep the rows ``ids``, each ``tokenizer.ggml.*_token_id`` is renumbered to its
    row (dropped when its token is not kept) and the vocabulary size is V'."""
    import gguf

    pos = {int(t): r for r, t in enumerate(ids)}
    vocab_arrays = {gguf.Keys.Tokenizer.LIST, gguf.Keys.Tokenizer.TOKEN_TYPE, gguf.Keys.Tokenizer.SCORES}
    vocab_size_key = gguf.Keys.LLM.VOCAB_SIZE.format(arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value, vtype, sub = _copy_value(field)
        if field.name in vocab_arrays:
            value = [value[i] for i in ids]
        elif field.name.startswith("tokenizer.ggml.") and field.name.endswith("_token_id"):
            if int(value) not in pos:
                continue  # a special token outside the kept ids: llama.cpp then uses none
            value = pos[int(value)]
        elif field.name == vocab_size_key:
            value = int(ids.size)
        writer.add_key_value(field.name, value, vtype, sub_type=sub)


class _Rows:
    """The rows ``ids`` of a GGUFReader tensor, shaped as :func:`_write_tensors` reads a tensor
    (``data``: numpy rows, ``tensor_type``)."""

    def __init__(self, t, ids: np.ndarray):
        self.data = np.ascontiguousarray(t.data[ids])
        self.tensor_type = t.tensor_type
