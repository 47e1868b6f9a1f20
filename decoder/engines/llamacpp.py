"""The llama.cpp engine (``"llamacpp"``): a GGUF file in llama.cpp through llama-cpp-python's
low-level bindings (``llama_decode`` with per-token output flags, ``llama_get_logits``,
``llama_get_embeddings_ith``, ``llama_memory_seq_rm``), the engine CPU users already run.
LoRA adapters (GGUF, :func:`decoder.models.gguf_export.lora_to_gguf`) are set per context with
``llama_set_adapters_lora`` (:meth:`LlamaCppEngine.set_lora`). The process-wide plumbing
(bindings, the compute thread, extra buffer types) is :mod:`decoder.engines.llamacpp_lib`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import weakref
from pathlib import Path

import numpy as np
import structlog
import torch

from decoder.engines.base import Capabilities, EngineError, forward_router, track
from decoder.engines.llamacpp_lib import (attach_threadpool, bindings, free_threadpool, llama_call,
                                          llama_extra_buffers, patch_switches, poll_level, amx_rows)
from decoder.models.gguf_export import (RESTRICTED_EMBD_TYPE_KEY, RESTRICTED_FULL_VOCAB_KEY, RESTRICTED_IDS_KEY,
                                        SPLIT_ID_KEY, SPLIT_KEY, ids_sha16, restricted_sidecars)

log = structlog.get_logger("decoder.engines.llamacpp")


def _common_prefix(a: list[int] | None, b) -> int:
    """Length of the longest common prefix of ``a`` (None: nothing) and ``b``."""
    if not a or b is None:
        return 0
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _cached_copy_hint(path: Path) -> str:
    """What to do when a file draftd wrote into its own cache (a requantised copy, a derived draft)
    does not load: it is damaged (a disk full, a copy cut short); deleted, it is written again."""
    from decoder.models.packaged import cache_root

    try:
        path.resolve().relative_to(cache_root().resolve())
    except ValueError:
        return ""
    return (f": it is draftd's own cached copy, damaged; delete {path.name} (in {path.parent}) and the next "
            f"start writes it again")


class LlamaCppSequence:
    """A request's slot (llama.cpp sequence ``seq_id``) in a :class:`LlamaCppEngine`'s context."""

    def __init__(self, engine: "LlamaCppEngine", seq_id: int = 0):
        self.engine = engine
        self.seq_id = seq_id
        self.length = 0
        self.released = False
        self._free_slot = None  # set by a multi-sequence engine's start()

    def forward(self, tokens: list[int], keep: int, hidden: bool = False):
        router = forward_router() if self.engine.n_seq > 1 else None
        if router is not None:  # a step scheduler fuses this with other requests' rows
            return router.call(self.engine, self, tokens, keep, hidden)
        return self.engine._decode(self, tokens, keep, hidden)

    def truncate(self, length: int) -> None:
        if self.length > length:
            e = self.engine
            e._check_open()
            if not e.L.llama_memory_seq_rm(e.mem, self.seq_id, length, -1):
                e._cells.pop(self.seq_id, None)
                raise EngineError(f"llama.cpp could not drop positions >= {length} of the sequence")
            self.length = length
            rec = e._cells.get(self.seq_id)
            if rec is not None:
                del rec[length:]
                e._ends[self.seq_id] = [b for b in e._ends.get(self.seq_id, []) if b <= length]

    def release(self) -> None:
        """Give the slot back (idempotent); its cells stay until the slot is next started, which
        keeps their common prefix with a prompt that asks for it (the prompt cache) and clears the rest."""
        if not self.released:
            self.released = True
            if self._free_slot is not None:
                self._free_slot()  # a weakref.finalize: runs once, then never again at garbage collection


KV_CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30}  # ggml.h's enum ggml_type (llama_cpp exports no BF16 name)


def auto_v_cache(n_seq: int, threads: int, fast_bf16: bool | None = None) -> str:
    """The V cache type ``v_cache="auto"`` picks: ``"bf16"`` (a verified row is the same bits as
    the row decoded alone with it, at any thread count and fused or not) unless attention over a
    bf16 V cache is slow on this CPU (``fast_bf16`` False; None: :func:`cpu_fast_bf16_attention`)
    and the engine runs one sequence at one thread, where llama.cpp's default ``"f16"`` is exact
    too and faster. bench/RESULTS.md has the measurements (``bench/vcache_bench.py``,
    ``bench/verify_cost_bench.py``) behind each side."""
    if fast_bf16 is None:
        fast_bf16 = cpu_fast_bf16_attention()
    return "f16" if not fast_bf16 and int(n_seq) == 1 and int(threads) == 1 else "bf16"


def cpuinfo_fields() -> dict[str, str]:
    """Linux's /proc/cpuinfo as ``{field: value}``, each field's first value (the first CPU's:
    ``model name``, ``cpu family``, ``model``, ``flags``, ...); {} where it cannot be read."""
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            k, _, v = line.partition(":")
            out.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return out


def _cpu_flags() -> set[str]:
    """The ``flags`` of Linux's /proc/cpuinfo (empty where it cannot be read)."""
    return set(cpuinfo_fields().get("flags", "").split())


@functools.cache
def cpu_native_bf16() -> bool:
    """True when the CPU has bf16 arithmetic in hardware (the ``avx512_bf16`` or ``amx_bf16`` flag
    of Linux's /proc/cpuinfo); False elsewhere or when it cannot be read."""
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def cpu_fast_bf16_attention(environ=None) -> bool:
    """True where flash attention over a bf16 V cache is at least as fast as over f16: the CPU has
    bf16 in hardware (:func:`cpu_native_bf16`), or draftd's blocked attention kernel
    (``scripts/patches/ggml-fa-bf16v-blocked.patch``, compiled where the CPU has AVX2, FMA and
    F16C, or AVX-512) runs, i.e. is not switched off by ``GGML_FA_BF16V_BLOCKED=0`` in
    ``environ`` (None: ``os.environ``)."""
    from decoder.engines.llamacpp_lib import patch_switches

    if cpu_native_bf16():
        return True
    return {"avx2", "fma", "f16c"} <= _cpu_flags() and bool(patch_switches(environ)["GGML_FA_BF16V_BLOCKED"])


def read_restricted_sidecars(model_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The two sidecars of the restricted draft ``model_path``
    (:func:`decoder.models.gguf_export.restricted_sidecars`): its id list, shape (V',), and its full
    input-embedding table, shape (V, row bytes), memory-mapped read-only.

    Raises:
        EngineError: a sidecar is missing, unreadable, empty or truncated (numpy's OSError, EOFError
            or ValueError: "Failed to read all data", "mmap length is greater than file size"); the
            message names the file and says to delete it (the draft's cache writes it again when
            any of the three files is missing: :func:`decoder.models.gguf_export.restricted_draft_gguf`).
    """
    model_path = Path(model_path)
    ids_file, embd_file = restricted_sidecars(model_path)

    def load(f: Path, mmap_mode: str | None) -> np.ndarray:
        try:
            return np.load(f, mmap_mode=mmap_mode)
        except (OSError, EOFError, ValueError) as e:  # an interrupted copy or write leaves a short .npy
            raise EngineError(f"{model_path.name} is a restricted-vocabulary draft and needs {ids_file.name} and "
                              f"{embd_file.name} beside it; {f.name} cannot be read ({type(e).__name__}: {e}): "
                              f"delete {f} so it is written again at the next start") from e

    return load(ids_file, None), load(embd_file, "r")


class LlamaCppEngine:
    """A GGUF model in llama.cpp.

    Args:
        path: the GGUF file (the packaged target, or the derived draft of
            :func:`decoder.models.gguf_export.derived_draft_gguf`).
        n_ctx: KV-cache size in tokens (default: the model's training context, at most 8192).
        threads: CPU threads for decode and batch (default: ``os.cpu_count()``).
        n_batch: most tokens fed per ``llama_decode`` (longer inputs go in chunks).
        embeddings: also extract final hidden states (llama.h: "extract embeddings (together with
            logits)"); needed for ``forward(..., hidden=True)``.
        flash_attn: llama.cpp's flash attention (on by default). Measured on the packaged GGUF:
            with it on, a token's logits are bit-identical whether it is fed alone (plain decoding)
            or inside a batch (verification), so greedy speculation equals plain greedy decoding
            token for token; with it off, batched and one-token logits differ by up to 0.99 and
            near-ties flip. It is also ~5-10 % faster per step here. The bench's peer
            (``Llama(flash_attn=True)``) runs the same setting.
        v_cache: element type of the V cache, ``"auto"`` (the default) or one of
            :data:`KV_CACHE_TYPES` (K stays f16). What losslessness needs is that a row's logits
            are the same bits whether it is verified in a block or decoded alone, at every cache
            length. ``"bf16"`` gives that everywhere: with f16 K and f16 V, llama.cpp's CPU flash
            attention decodes a one-row query over a KV view of 512 cells or more (from the 257th
            cached token) with the cache split across threads and the partial softmaxes merged, a
            different summation order than the block's, and several sequences fused in one
            ``llama_decode`` take another path again, so near-ties could flip and a served greedy
            output differ from plain decoding; with V in another type than K neither path is
            taken. ``"f16"`` is llama.cpp's (and the bench peer's) default and faster here (the
            bf16 V cache's price: bench/RESULTS.md, "the bf16 V cache"); one sequence at one thread
            has nothing to split or fuse, so f16 is exact there (tested). ``"auto"`` = f16 for
            ``n_seq == 1`` and ``threads == 1``, bf16 otherwise.
        n_seq: sequences held at once (llama.cpp's ``n_seq_max``; serve's ``serve.max_batch``).
            1 (default): one sequence, :meth:`start` clears the cache, as before. > 1: the KV
            cache holds ``n_seq`` streams of ``n_ctx`` tokens each (``kv_unified`` off, so a
            sequence's cells stay in position order as when decoded alone, whatever its batch
            mates did), :meth:`start` takes a free one, and :meth:`forward_batch` decodes the
            rows of several in one ``llama_decode``. Needs ``flash_attn``.

    Raises:
        EngineError: llama-cpp-python missing, or the file does not load.
        ValueError: ``v_cache`` not ``"auto"`` or one of :data:`KV_CACHE_TYPES`, or ``n_seq`` < 1, or
            ``n_seq`` > 1 without ``flash_attn``.
    """

    name = "llamacpp"

    def __init__(self, path: str | Path, n_ctx: int | None = None, threads: int | None = None,
                 n_batch: int = 512, embeddings: bool = False, flash_attn: bool = True, v_cache: str = "auto",
                 n_seq: int = 1):
        if v_cache != "auto" and v_cache not in KV_CACHE_TYPES:
            raise ValueError(f"v_cache={v_cache!r}: use 'auto' or one of {sorted(KV_CACHE_TYPES)}")
        if int(n_seq) < 1:
            raise ValueError(f"n_seq={n_seq!r}: must be >= 1")
        if n_seq > 1 and not flash_attn:
            raise ValueError("n_seq > 1 needs flash_attn=True (a started sequence's cells are not zeroed without it)")
        self.n_seq = int(n_seq)
        poll = poll_level()  # before anything is loaded: a bad DRAFTD_LLAMA_POLL leaks nothing
        L = self.L = bindings()
        self.path = Path(path)
        if not self.path.is_file():
            raise EngineError(f"GGUF file {str(path)!r} does not exist")
        self.extra_bufts, _ = llama_extra_buffers(self.path)
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = self.extra_bufts
        self.model = L.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self.model:
            raise EngineError(f"llama.cpp could not load {str(path)!r} (not a GGUF model it supports?){_cached_copy_hint(Path(path))}")
        train_ctx = int(L.llama_model_n_ctx_train(self.model))
        self.context_length = int(n_ctx or min(train_ctx, 8192))
        self.threads = int(threads or os.cpu_count() or 1)
        self.n_batch = int(n_batch)
        self.embeddings = bool(embeddings)
        self._emb_on = self.embeddings  # hidden-state extraction on the context now (llama_set_embeddings)
        self._create_context(path, flash_attn, v_cache)
        self._pool = attach_threadpool(self.ctx, self.threads, poll)  # workers kept across decodes, as llama-server
        self.mem = L.llama_get_memory(self.ctx)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_out = int(L.llama_vocab_n_tokens(self.vocab))  # logit rows llama.cpp computes per output
        self.vocab_size = self.n_out  # the vocabulary forward's logits are in
        self.hidden_size = int(L.llama_model_n_embd(self.model))
        # an FR-Spec restricted draft (gguf_export.restricted_draft_gguf): V' output rows, inputs fed as
        # embeddings from the full table, logits scattered back to the full vocabulary
        self.out_ids: torch.Tensor | None = None  # (V',) int64 full id of each output row
        self._in_table = None  # (V, row bytes) the full token_embd, in its ggml type (memory-mapped)
        full = self._meta_str(RESTRICTED_FULL_VOCAB_KEY)
        if full is not None:
            self._load_restricted(int(full))
        eos = {int(L.llama_vocab_eos(self.vocab)), int(L.llama_vocab_eot(self.vocab))}
        eos = {t for t in eos if 0 <= t < self.n_out}
        self.eos_ids = frozenset(int(self.out_ids[t]) for t in eos) if self.out_ids is not None else frozenset(eos)
        self._batch = L.llama_batch_init(self.n_batch, self.hidden_size if self.out_ids is not None else 0, 1)
        self._loras: dict[str, object] = {}
        self.lora: str | None = None  # the adapter key now set on the context
        self._closed = False
        self._busy = threading.Lock()  # held by a decode; close() waits for it
        self._free = list(range(self.n_seq))  # free sequence ids (n_seq > 1)
        # the prompt cache: per sequence id, the token ids whose K/V fill its cells [0, len) under
        # the adapters now set (start(prefix=...) keeps a common prefix of them); no entry: unknown
        self._cells: dict[int, list[int]] = {}
        self._ends: dict[int, list[int]] = {}  # per sequence id, where each forward since its start ended (f16)
        self._adapters_now: tuple = (None, 1.0)
        self._slots = threading.RLock()  # RLock: a sequence's finalizer may run inside start() (GC)
        self._offset_lora = None  # a split Q4_1 file's offset adapter, under every forward
        self.offset_lora: Path | None = None
        split = self._meta_str(SPLIT_KEY)
        if split is not None:
            self._apply_offset_lora(self.path.parent / split)

    def _create_context(self, path, flash_attn: bool, v_cache: str) -> None:
        """The llama.cpp context (``self.ctx``) for the settings ``__init__`` has set; the model is freed
        and EngineError raised where llama.cpp cannot create it."""
        L = self.L
        cp = L.llama_context_default_params()
        cp.n_ctx = self.context_length * self.n_seq  # n_ctx per sequence = n_ctx / n_seq_max (not unified)
        cp.n_batch = cp.n_ubatch = self.n_batch
        cp.n_seq_max = self.n_seq
        cp.kv_unified = False
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.embeddings = self.embeddings
        cp.pooling_type = 0  # LLAMA_POOLING_TYPE_NONE: per-token hidden states
        cp.flash_attn_type = 1 if flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        self.flash_attn = bool(flash_attn)
        if v_cache == "auto":
            v_cache = auto_v_cache(self.n_seq, self.threads)
        cp.type_v = KV_CACHE_TYPES[v_cache]
        self.v_cache = v_cache
        # a cell is the same bits whatever the call that computed it (a prefill chunk of any size, a
        # verification block, one token) with a bf16 V cache, not with f16: what the prompt cache may keep
        # (_keep_prefix; tests/decoder/test_engines.py checks both)
        self.shape_invariant_cells = v_cache == "bf16"
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise EngineError(f"llama.cpp could not create a context of {self.context_length} tokens for {path}")

    def _load_restricted(self, full_vocab: int) -> None:
        """The sidecars of a restricted draft (:func:`decoder.models.gguf_export.restricted_sidecars`):
        its id list, checked against the file's hash, and the full input-embedding table."""
        try:
            ids, table = read_restricted_sidecars(self.path)
        except EngineError:
            self._free_model()
            raise
        if (ids_sha16(ids) != self._meta_str(RESTRICTED_IDS_KEY) or ids.shape != (self.n_out,)
                or table.shape[0] != full_vocab or int(ids.max()) >= full_vocab):
            self._free_model()
            raise EngineError(f"the sidecars of the restricted draft {self.path.name} do not match it; delete "
                              f"the three files so they are written again")
        from gguf import GGMLQuantizationType

        self._in_type = GGMLQuantizationType(int(self._meta_str(RESTRICTED_EMBD_TYPE_KEY)))
        self._in_table = table
        self.out_ids = torch.from_numpy(ids.astype(np.int64))
        self._out_np = self.out_ids.numpy()
        self.vocab_size = full_vocab

    def _llama_decode(self, batch) -> int:
        """``llama_decode`` of ``batch`` on this context, under its threadpool's lock (the pool is
        shared with the process's other contexts of the same thread count:
        :func:`~decoder.engines.llamacpp_lib.attach_threadpool`); returns llama.cpp's code."""
        if self._pool is None:
            return llama_call(self.L.llama_decode, self.ctx, batch)
        with self._pool.lock:
            return llama_call(self.L.llama_decode, self.ctx, batch)

    def _free_model(self) -> None:
        """Free the context and model of a construction that fails before the engine is complete."""
        self.L.llama_free(self.ctx)
        free_threadpool(None, self._pool)
        self.L.llama_model_free(self.model)

    def input_embeddings(self, tokens) -> np.ndarray:
        """(n, H) float32 input rows of full-vocabulary ``tokens`` (a restricted draft), dequantised
        from the full table as llama.cpp's ``get_rows`` does. Raises EngineError for an id >= V."""
        from gguf import GGMLQuantizationType

        t = np.asarray(tokens, dtype=np.int64)
        if t.size and (int(t.min()) < 0 or int(t.max()) >= self.vocab_size):
            raise EngineError(f"token ids must be in 0..{self.vocab_size - 1} (got {int(t.min())}..{int(t.max())})")
        raw = self._in_table[t]
        if self._in_type == GGMLQuantizationType.Q8_0:  # blocks of (d f16, 32 x int8): x = d * q, in f32 as ggml
            blk = raw.reshape(len(t), -1, 34)
            d = blk[..., :2].copy().view(np.float16).astype(np.float32)
            out = blk[..., 2:].view(np.int8).astype(np.float32) * d  # 30 us a row here, gguf's dequantize 175
        else:
            from gguf.quants import dequantize

            out = dequantize(raw, self._in_type)
        return np.ascontiguousarray(out, dtype=np.float32).reshape(len(t), self.hidden_size)

    def _fill_inputs(self, b, at: int, tokens) -> None:
        """Batch positions ``at..at+len(tokens)-1``: token ids, or (restricted draft) their embeddings."""
        if self._in_table is None:
            for i, t in enumerate(tokens):
                b.token[at + i] = int(t)
            return
        e = self.input_embeddings(tokens)
        ctypes.memmove(ctypes.addressof(b.embd.contents) + at * self.hidden_size * 4, e.ctypes.data, e.nbytes)

    def _full_logits(self, rows: np.ndarray) -> np.ndarray:
        """(k, n_out) logits -> (k, vocab_size): a restricted draft's rows scattered to their full
        ids, -inf elsewhere (q = 0 there); other models' rows as they are."""
        if self.out_ids is None:
            return rows
        full = np.full((rows.shape[0], self.vocab_size), -np.inf, dtype=np.float32)
        full[:, self._out_np] = rows
        return full

    def _meta_str(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = self.L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", "replace")

    def _apply_offset_lora(self, path: Path) -> None:
        """A split Q4_1 model (:func:`decoder.models.gguf_export.q4_1_split_gguf`) is Q4_0 blocks plus
        the per-block offsets as a LoRA adapter; without the adapter its weights are wrong, so a
        missing or refused one fails the load."""
        if not path.is_file():
            self.close()
            raise EngineError(f"{self.path.name} is a split Q4_1 model and needs its offset adapter {path}, which is "
                              f"missing; delete {self.path} so it is written again")
        ad = self.L.llama_adapter_lora_init(self.model, str(path).encode())
        if not ad:
            self.close()
            raise EngineError(f"llama.cpp refused the offset adapter {path} of the split model {self.path.name}; "
                              f"delete both so they are written again")
        want, buf = self._meta_str(SPLIT_ID_KEY), ctypes.create_string_buffer(4096)
        n = self.L.llama_adapter_meta_val_str(ad, SPLIT_ID_KEY.encode(), buf, len(buf))
        got = buf.value.decode("utf-8", "replace") if n >= 0 else None
        if want is None or got != want:
            self.L.llama_adapter_lora_free(ad)
            self.close()
            raise EngineError(f"the offset adapter {path} belongs to split {got!r}, not to {self.path.name} "
                              f"({want!r}); delete both so they are written again")
        self._offset_lora, self.offset_lora = ad, path
        self._set_adapters(None, 1.0)

    def _check_open(self) -> None:
        """Every call into the context goes through here: after :meth:`close` its pointers are
        freed, and llama.cpp would read freed memory (a segfault), so refuse instead."""
        if self._closed:
            raise EngineError(f"the llama.cpp engine for {self.path.name} is closed")

    def start(self, prefix: list[int] | None = None) -> LlamaCppSequence:
        """A new sequence. n_seq = 1: the one sequence (any earlier one is invalid). n_seq > 1: a
        free sequence id.

        ``prefix`` (the prompt cache, as llama-server's ``cache_prompt`` and vLLM's prefix
        caching): the tokens the caller is about to feed first (a prompt without its last token).
        The cells of the longest common prefix of ``prefix`` and what a sequence slot last held
        (n_seq > 1: the free slot with the longest one) are kept and the sequence starts at that
        ``length`` (tokens): feed ``prefix[length:]`` only. Exact, not approximate: a cell's K/V
        depend only on the tokens at and before it, the adapters and the shape of the call that
        computed it, and only cells a fresh prefill would compute bit for bit are kept (any common
        prefix with a bf16 V cache, where a cell is the same bits from a prefill chunk, a
        verification block or one token; with f16 only an identical earlier prefill, see
        :meth:`_keep_prefix`). Cells computed under other LoRA adapters are never kept
        (``set_lora`` forgets them). None (default), or without flash attention: an empty cache,
        ``length`` 0.

        Raises:
            EngineError: closed, or (n_seq > 1) all ``n_seq`` sequences in use.
        """
        self._check_open()
        reuse = prefix is not None and self.flash_attn
        if self.n_seq == 1:
            with self._busy:
                self._check_open()
                m = self._keep_prefix(0, prefix) if reuse else 0
                if not m:
                    # Metadata only with flash attention (zeroing the buffers cost 19 ms a request at 8192 tokens;
                    # masked cells never reach its softmax); without it a stale cell holding inf/NaN (an f16
                    # overflow) turned a later request's logits to NaN (QA), so the buffers are zeroed there.
                    self.L.llama_memory_clear(self.mem, not self.flash_attn)
                    self._cells[0], self._ends[0] = [], []
            seq = LlamaCppSequence(self, 0)
            seq.length = m
            track(seq)
            return seq
        with self._slots:
            if not self._free:
                raise EngineError(f"all {self.n_seq} sequences of the llama.cpp context are in use: release one "
                                  f"(LlamaCppSequence.release) or build the engine with a larger n_seq")
            self._free.sort()
            sid = self._free[0]
            if reuse:  # the free slot holding the longest common prefix (the lowest id on a tie)
                sid = max(self._free, key=lambda s: (_common_prefix(self._cells.get(s), prefix), -s))
            self._free.remove(sid)
        with self._busy:
            self._check_open()
            m = self._keep_prefix(sid, prefix) if reuse else 0
            if not m:
                self.L.llama_memory_seq_rm(self.mem, sid, -1, -1)  # flash attention: masked cells never reach the softmax
                self._cells[sid], self._ends[sid] = [], []
        seq = LlamaCppSequence(self, sid)
        seq.length = m
        seq._free_slot = weakref.finalize(seq, self._release, sid)  # dropped without release(): freed at GC
        track(seq)
        return seq

    def clear_prompt_cache(self) -> None:
        """Forget what every slot holds: the next :meth:`start` keeps nothing (a measurement that
        must pay its own prefill)."""
        with self._busy:
            self._cells.clear()
            self._ends.clear()

    def _keep_prefix(self, sid: int, prefix: list[int]) -> int:
        """Keep sequence ``sid``'s cells of its longest common prefix with ``prefix`` that a fresh
        prefill would compute bit for bit, and drop the rest (call holding ``_busy``); the tokens
        kept, 0 when none (nothing dropped then).

        With a bf16 V cache a cell is the same bits however it was computed (a prefill chunk of any
        size, a verification block, one token), so any common prefix is kept. With f16 it is not (a
        cell from a 10-row call differs from the same cell in a 600-row prefill, and the logits
        after it by up to ~1): only cells that the slot's earlier calls computed exactly as a fresh
        prefill of ``prefix`` would (chunks of ``n_batch`` from position 0, then the rest in one
        call) are kept: the same prompt again, or whole ``n_batch`` chunks of a longer one.
        """
        rec = self._cells.get(sid)
        m = _common_prefix(rec, prefix)
        if m and not self.shape_invariant_cells:
            ends = self._ends.get(sid, [])
            n, nb = len(prefix), self.n_batch
            m = next((c for c in [n] + list(range(m - m % nb, 0, -nb)) if c <= m and c in ends
                      and [b for b in ends if b < c] == list(range(nb, c, nb))), 0)
        if m and not self.L.llama_memory_seq_rm(self.mem, sid, m, -1):
            return 0  # a memory that cannot drop a suffix: start empty
        if m:
            del rec[m:]
            self._ends[sid] = [b for b in self._ends.get(sid, []) if b <= m]
        return m

    def _release(self, seq_id: int) -> None:
        if self._closed:
            return
        with self._slots:
            if seq_id not in self._free and self.n_seq > 1:
                self._free.append(seq_id)

    @property
    def free_sequences(self) -> int:
        """Sequences :meth:`start` can still hand out (n_seq > 1; 1 for a one-sequence engine)."""
        return len(self._free) if self.n_seq > 1 else 1

    def _decode(self, seq: LlamaCppSequence, tokens: list[int], keep: int, hidden: bool):
        with self._busy:  # a close() from another thread waits for this decode instead of freeing under it
            return self._decode_locked(seq, tokens, keep, hidden)

    def _decode_locked(self, seq: LlamaCppSequence, tokens: list[int], keep: int, hidden: bool):
        self._check_open()
        L, n = self.L, len(tokens)
        if seq.released:
            raise EngineError(f"sequence {seq.seq_id} was released: start() a new one")
        if n < 1 or not 1 <= keep <= n:
            raise ValueError(f"forward: need 1 <= keep={keep} <= len(tokens)={n}")
        if seq.length + n > self.context_length:
            raise EngineError(f"{seq.length + n} tokens exceed the llama.cpp context of {self.context_length}: "
                              f"shorten the request (LlamaCppEngine(n_ctx=...) sets the context; serve runs the "
                              f"model's own, at most 8192)")
        if hidden and not self.embeddings:
            raise EngineError("hidden states need LlamaCppEngine(embeddings=True)")
        if self.embeddings and hidden != self._emb_on:
            # with extraction on, llama.cpp outputs every row of a batch (logits included), so a
            # prefill or a plain step that wants no hidden state would pay a full-vocabulary head
            # per row: it is on only for the calls that ask for hidden states
            L.llama_set_embeddings(self.ctx, hidden)
            self._emb_on = hidden
        rows, hs = [], []
        for c0 in range(0, n, self.n_batch):  # chunks of n_batch; outputs only in the last `keep`
            chunk = tokens[c0 : c0 + self.n_batch]
            b = self._batch
            b.n_tokens = len(chunk)
            first_out = n - keep
            outs = 0
            self._fill_inputs(b, 0, chunk)
            for i, t in enumerate(chunk):
                b.pos[i] = seq.length + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq.seq_id
                out = c0 + i >= first_out
                b.logits[i] = 1 if out else 0
                outs += out
            rc = self._llama_decode(b)
            if rc != 0:
                self._cells.pop(seq.seq_id, None)
                raise EngineError(f"llama_decode returned {rc} (1: no KV slot; <0: error) at position {seq.length}")
            seq.length += len(chunk)
            self._record(seq, chunk)
            if outs:
                if self._emb_on:
                    # llama.cpp then outputs every token of the batch, whatever b.logits says
                    # (llama-batch.cpp: "embeddings required but some input tokens were not marked
                    # as outputs -> overriding"), so llama_get_logits holds len(chunk) rows: pick
                    # the wanted ones by their batch position, as llama_get_embeddings_ith does.
                    want = slice(len(chunk) - outs, len(chunk))
                    rows.append(self._outputs(L.llama_get_logits(self.ctx), len(chunk), self.n_out)[want].copy())
                    if hidden:
                        hs.append(self._outputs(L.llama_get_embeddings(self.ctx), len(chunk),
                                                self.hidden_size)[want].copy())
                else:
                    rows.append(self._outputs(L.llama_get_logits(self.ctx), outs, self.n_out).copy())
        logits = torch.from_numpy(self._full_logits(rows[0] if len(rows) == 1 else np.concatenate(rows)))
        if hidden:
            return logits, torch.from_numpy(np.concatenate(hs))
        return logits

    def forward_batch(self, items: list[tuple[LlamaCppSequence, list[int], int]], hidden: bool = False) -> list:
        """Several sequences' rows in as few ``llama_decode`` calls as fit: each item
        ``(seq, tokens, keep)`` appends ``tokens`` (n >= 1) to its own sequence (each sequence at
        most once per call) and gets back what :meth:`LlamaCppSequence.forward` would return for
        it, logits (keep, V) float32 (with ``hidden``: (logits, hidden (keep, H))), in the order of
        ``items``. Items are laid out by sequence id and packed into decodes of at most
        ``n_batch`` tokens; an item longer than ``n_batch`` is decoded alone, in chunks.

        Raises:
            ValueError: a ``keep`` out of 1..n, or a sequence twice.
            EngineError: a sequence not of this engine or released, past the context, hidden
                states without ``embeddings``, or a failing ``llama_decode``.
        """
        with self._busy:
            return self._forward_batch_locked(items, hidden)

    def _forward_batch_locked(self, items, hidden: bool) -> list:
        self._check_open()
        L = self.L
        seen = set()
        for seq, tokens, keep in items:
            n = len(tokens)
            if seq.engine is not self or seq.released:
                raise EngineError(f"forward_batch: sequence {seq.seq_id} is not a live sequence of this engine")
            if seq.seq_id in seen:
                raise ValueError(f"forward_batch: sequence {seq.seq_id} appears twice")
            seen.add(seq.seq_id)
            if n < 1 or not 1 <= keep <= n:
                raise ValueError(f"forward_batch: need 1 <= keep={keep} <= len(tokens)={n}")
            if seq.length + n > self.context_length:
                raise EngineError(f"{seq.length + n} tokens exceed the llama.cpp context of {self.context_length} "
                                  f"per sequence: shorten the request")
        if hidden and not self.embeddings:
            raise EngineError("hidden states need LlamaCppEngine(embeddings=True)")
        if self.embeddings and hidden != self._emb_on:
            L.llama_set_embeddings(self.ctx, hidden)
            self._emb_on = hidden
        out: list = [None] * len(items)
        order = sorted(range(len(items)), key=lambda j: items[j][0].seq_id)  # consecutive ids share a ubatch
        groups: list[list[int]] = []
        size = 0
        for j in order:
            n = len(items[j][1])
            if n > self.n_batch:  # alone, chunked as a single forward is
                seq, tokens, keep = items[j]
                out[j] = self._decode_locked(seq, tokens, keep, hidden)
                continue
            if not groups or size + n > self.n_batch:
                groups.append([])
                size = 0
            groups[-1].append(j)
            size += n
        b = self._batch
        for g in groups:
            i = wanted_rows = 0
            firsts: list[tuple[int, int]] = []  # (item, its first wanted row in the output buffers)
            for j in g:
                seq, tokens, keep = items[j]
                self._fill_inputs(b, i, tokens)
                # with extraction on llama.cpp outputs every row (see _decode_locked): rows by batch position
                firsts.append((j, i + len(tokens) - keep if self._emb_on else wanted_rows))
                wanted_rows += keep
                for k, t in enumerate(tokens):
                    b.pos[i] = seq.length + k
                    b.n_seq_id[i] = 1
                    b.seq_id[i][0] = seq.seq_id
                    b.logits[i] = 1 if k >= len(tokens) - keep else 0
                    i += 1
            b.n_tokens = i
            rc = self._llama_decode(b)
            if rc != 0:
                for j in g:
                    self._cells.pop(items[j][0].seq_id, None)
                raise EngineError(f"llama_decode returned {rc} (1: no KV slot; <0: error) for a batch of "
                                  f"{len(g)} sequences, {i} tokens")
            n_rows = i if self._emb_on else wanted_rows
            logits = self._outputs(L.llama_get_logits(self.ctx), n_rows, self.n_out)
            hid = self._outputs(L.llama_get_embeddings(self.ctx), n_rows, self.hidden_size) if hidden else None
            for j, r in firsts:  # each sequence's rows: one copy of its own (none holds its mates' rows)
                seq, tokens, keep = items[j]
                seq.length += len(tokens)
                self._record(seq, tokens)
                rows = torch.from_numpy(self._full_logits(logits[r: r + keep].copy()))
                out[j] = (rows, torch.from_numpy(hid[r: r + keep].copy())) if hidden else rows
        return out

    @staticmethod
    def _outputs(ptr, n: int, width: int) -> np.ndarray:
        """A view, (n, width) float32, of the first ``n`` rows of a llama.cpp output buffer
        (``llama_get_logits`` / ``llama_get_embeddings``: the outputs in the batch's order, which
        llama.cpp restores when it computed them in another). The next decode overwrites it: copy
        what is kept before then."""
        if not ptr:
            raise EngineError(f"llama.cpp returned no output buffer for {n} rows")
        return np.ctypeslib.as_array(ptr, shape=(n, width))

    def _record(self, seq: LlamaCppSequence, tokens) -> None:
        """The prompt cache's record of ``seq``'s cells after ``tokens`` were decoded into them."""
        rec = self._cells.get(seq.seq_id)
        if rec is not None and len(rec) + len(tokens) == seq.length:
            rec.extend(int(t) for t in tokens)
            if not self.shape_invariant_cells:  # where calls end matters only where cells depend on them
                self._ends.setdefault(seq.seq_id, []).append(seq.length)
        else:  # out of step with the cells (never expected): unknown, never reused
            self._cells.pop(seq.seq_id, None)

    # ---- LoRA adapters (GGUF) ----------------------------------------------------------------
    def load_lora(self, key: str, path: str | Path) -> None:
        """Load a GGUF LoRA adapter under ``key`` (not yet applied). Raises EngineError."""
        self._check_open()
        if key in self._loras:
            return
        ad = self.L.llama_adapter_lora_init(self.model, str(path).encode())
        if not ad:
            raise EngineError(f"llama.cpp refused the LoRA adapter {str(path)!r} for {self.path.name}")
        self._loras[key] = ad

    def set_lora(self, key: str | None, scale: float = 1.0) -> None:
        """Apply the adapter ``key`` (None: none) to every following forward. Call between
        requests only (the decoder's between-request hook)."""
        self._check_open()
        if key is not None and key not in self._loras:
            raise EngineError(f"LoRA adapter {key!r} is not loaded (loaded: {self.loras}); load_lora it first")
        self._set_adapters(key, scale)
        self.lora = key

    def _set_adapters(self, key: str | None, scale: float) -> None:
        """The context's adapters: a split model's offsets (scale 1) and the adapter ``key``."""
        L = self.L
        ads = ([(self._offset_lora, 1.0)] if self._offset_lora is not None else []) + \
              ([(self._loras[key], float(scale))] if key is not None else [])
        if not ads:
            rc = L.llama_set_adapters_lora(self.ctx, None, 0, None)
        else:
            arr = (L.llama_adapter_lora_p_ctypes * len(ads))(*(a for a, _ in ads))
            rc = L.llama_set_adapters_lora(self.ctx, arr, len(ads), (ctypes.c_float * len(ads))(*(x for _, x in ads)))
        if rc != 0:
            self._cells.clear()
            raise EngineError(f"llama_set_adapters_lora({key!r}) returned {rc}")
        if (key, float(scale)) != self._adapters_now:  # cells computed under other adapters: never reused
            self._cells.clear()
            self._adapters_now = (key, float(scale))

    def drop_lora(self, key: str) -> None:
        """Free an adapter that is not applied."""
        if key == self.lora:
            raise EngineError(f"adapter {key!r} is in use; set another first")
        self._check_open()
        ad = self._loras.pop(key, None)
        if ad:
            self.L.llama_adapter_lora_free(ad)

    @property
    def capabilities(self) -> Capabilities:
        """Hidden states only when built with ``embeddings=True``; LoRA per context; computes on
        llama.cpp's own thread pool."""
        return Capabilities(hidden_states=self.embeddings, lora=True, batch=self.n_seq > 1, torch_module=False,
                            own_threads=True, max_sequences=self.n_seq, prompt_cache=self.flash_attn)

    @property
    def loras(self) -> list[str]:
        return list(self._loras)

    def describe(self) -> dict:
        return {"engine": self.name, "model": self.path.name, "device": "cpu", "threads": self.threads,
                "n_ctx": self.context_length, "n_seq": self.n_seq, "v_cache": self.v_cache, "lora": self.lora,
                "extra_buffer_types": self.extra_bufts,
                # as ggml reads it, one entry per thread count; None off the AMX path (decoder.engines.amx_rows)
                "amx_vnni_max_rows": list(patch_switches()["GGML_AMX_VNNI_MAX_ROWS"]) if amx_rows() else None,
                "head_rows": self.n_out}  # < vocab_size for a restricted (FR-Spec) draft

    def close(self) -> None:
        with self._busy:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._cells.clear()
        L = self.L
        L.llama_batch_free(self._batch)
        L.llama_free(self.ctx)
        free_threadpool(None, self._pool)
        for ad in self._loras.values():
            L.llama_adapter_lora_free(ad)
        self._loras.clear()
        if self._offset_lora is not None:
            L.llama_adapter_lora_free(self._offset_lora)
            self._offset_lora = None
        L.llama_model_free(self.model)

    def __del__(self):  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass


