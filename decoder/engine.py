"""Engines: what runs a model's forward passes for the decoder.

An engine owns a model and its KV cache; the decoder asks it for one thing, over and over:
*feed these new tokens after the cached ones and give me the logits (and, if asked, the final
hidden states) at the last ``keep`` of them*, and, after verification, *forget every cached
position beyond n*. Speculative sampling, acceptance accounting and the records stay in the
decoder (:mod:`decoder.speculative`); only the forward passes move.

- :class:`TorchEngine` (``"torch"``): a transformers causal LM (GPU, any hub id or local path;
  on CPU, fp32 with the small-M kernels of :mod:`decoder.fastpath`).
- :class:`LlamaCppEngine` (``"llamacpp"``): a GGUF file in llama.cpp through llama-cpp-python's
  low-level bindings (``llama_decode`` with per-token output flags, ``llama_get_logits``,
  ``llama_get_embeddings_ith``, ``llama_memory_seq_rm``), the engine CPU users already run.
  LoRA adapters (GGUF, :func:`decoder.gguf_export.lora_to_gguf`) are set per context with
  ``llama_set_adapters_lora`` (:meth:`LlamaCppEngine.set_lora`).

``models.engine = auto | torch | llamacpp`` picks one (:func:`choose_engine`): ``auto`` takes
llama.cpp for a GGUF target on CPU when llama-cpp-python is installed, and says why in
:attr:`EngineChoice.reason` (the decoder puts the engine's name in every record).

One sequence per engine at a time: the decoder serves requests one at a time under its lock,
and :meth:`Engine.start` begins a request with an empty cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import structlog
import torch

from decoder.llamacpp_lib import SPLIT_ID_KEY, SPLIT_KEY, EngineError, bindings, llamacpp_available

_llama = bindings  # this module's name for it

ENGINES = ("auto", "torch", "llamacpp")
log = structlog.get_logger("decoder.engine")


class Sequence(Protocol):
    """One request's KV state inside an engine."""

    length: int  # tokens in the cache

    def forward(self, tokens: list[int], keep: int, hidden: bool = False):
        """Append ``tokens`` (n >= 1) to the cache; return logits (keep, V) float32 at the last
        ``keep`` <= n of them, and with ``hidden`` also their final hidden states (keep, H)
        as a tuple (logits, hidden)."""

    def truncate(self, length: int) -> None:
        """Drop cached positions >= ``length`` (the verification's rejected tail)."""


class Engine(Protocol):
    name: str  # "torch" | "llamacpp"
    vocab_size: int  # V: rows of the LM head
    hidden_size: int  # H
    context_length: int | None  # tokens the model attends over, None = unknown
    eos_ids: frozenset[int]

    def start(self) -> Sequence:
        """A new request's sequence (empty cache)."""

    def describe(self) -> dict:
        """What runs, for records and status: engine, model, threads, dtype."""


# ---- transformers --------------------------------------------------------------------------------
class TorchSequence:
    """A request's ``DynamicCache`` on a :class:`TorchEngine`."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        from transformers import DynamicCache

        self.model, self.device = model, device
        self.cache = DynamicCache(config=model.config)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def forward(self, tokens: list[int], keep: int, hidden: bool = False):
        x = torch.tensor([tokens], device=self.device)
        if not hidden:
            return self.model(input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=keep).logits[0]
        out = self.model(input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=keep,
                         output_hidden_states=True)
        return out.logits[0], out.hidden_states[-1][0, -keep:]

    def truncate(self, length: int) -> None:
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5: crop(-n) removes n positions


class TorchEngine:
    """A transformers causal LM as an engine (the decoder's default, and every non-GGUF model).

    model: a ``PreTrainedModel`` with ``logits_to_keep`` (Llama/Gemma/Qwen families)."""

    name = "torch"

    def __init__(self, model: torch.nn.Module, eos_ids=()):
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.hidden_size = int(getattr(model.config, "hidden_size", 0))
        self.context_length = getattr(model.config, "max_position_embeddings", None)
        self.eos_ids = frozenset(eos_ids)

    def start(self) -> TorchSequence:
        return TorchSequence(self.model, self.device)

    def describe(self) -> dict:
        p = next(self.model.parameters())
        return {"engine": self.name, "model": getattr(self.model.config, "_name_or_path", "") or
                type(self.model).__name__, "device": str(p.device), "dtype": str(p.dtype).replace("torch.", ""),
                "threads": torch.get_num_threads()}


# ---- llama.cpp -----------------------------------------------------------------------------------
_init_lock = threading.Lock()  # the AMX decision and the llama.cpp thread, made once
_extra: tuple[bool, str] | None = None  # this process's decision (llama_extra_buffers)
_route = False  # llama_call runs llama.cpp's compute on its own thread (AMX tiles in use)
_llama_q = None  # the llama.cpp thread's work queue (_llama_queue)
_llama_ident: int | None = None


def llama_call(fn, *args):
    """``fn(*args)`` for a llama.cpp call that computes (``llama_decode``, ``Llama.eval``,
    ``Llama.create_completion``): on the process's one llama.cpp thread while AMX tiles are in use
    (:func:`llama_extra_buffers`), directly otherwise.

    Why: ggml configures a thread's AMX tiles once (a thread-local flag), and oneDNN, which torch's
    bf16 matmuls run on, releases the tiles after each of its AMX kernels. On a thread that ran
    both, ggml's next tile instruction found no configuration and the process died of SIGILL
    (measured: a torch bf16 matmul between two batched decodes on one thread). The calling thread
    is thread 0 of ggml's compute (its other threads are ggml's own), so llama.cpp's compute
    calls run on a thread that runs nothing else; measured no slower (7.07 vs 7.10 ms a step at
    2 threads) in the build scripts/install makes (GGML_OPENMP=OFF: with OpenMP, any thread but
    the main one decoded 2.5-5x slower).
    """
    if not _route or threading.get_ident() == _llama_ident:
        return fn(*args)
    import concurrent.futures

    fut: concurrent.futures.Future = concurrent.futures.Future()
    _llama_queue().put((fut, fn, args))
    try:
        return fut.result()
    except BaseException:
        # interrupted (Ctrl-C) while llama.cpp still computes on our context: wait it out, or a
        # close() in the caller's cleanup would free the context under the running decode
        while not fut.done():
            try:
                concurrent.futures.wait([fut])
            except BaseException:  # noqa: BLE001 - a second interrupt: keep waiting all the same
                pass
        raise


def _llama_queue():
    """The llama.cpp thread's work queue, its daemon thread started on first use (a daemon:
    concurrent.futures' executors stop taking work once the main thread returns, and a serving
    thread may still be decoding then)."""
    global _llama_q
    with _init_lock:
        if _llama_q is None:
            import queue

            q: queue.SimpleQueue = queue.SimpleQueue()

            def run():
                global _llama_ident
                _llama_ident = threading.get_ident()
                while True:
                    fut, fn, args = q.get()
                    if not fut.set_running_or_notify_cancel():
                        continue
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)

            threading.Thread(target=run, name="llama.cpp", daemon=True).start()
            _llama_q = q
    return _llama_q

# Loads a GGUF with llama.cpp's extra buffer types and decodes one 8-token batch: the call whose
# AMX matmul faults in a miscompiled build. Run in a child process (a fault must not kill ours).
_PROBE = """
import sys
import llama_cpp.llama_cpp as L
L.llama_backend_init()
mp = L.llama_model_default_params()
mp.use_extra_bufts = True
m = L.llama_model_load_from_file(sys.argv[1].encode(), mp)
if not m:
    sys.exit(3)
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 64, 16, 16, 1, 1
ctx = L.llama_init_from_model(m, cp)
toks = (L.llama_token * 8)(*range(1, 9))
sys.exit(0 if ctx and L.llama_decode(ctx, L.llama_batch_get_one(toks, 8)) == 0 else 3)
"""


def extra_buffer_policy(system_info: str, probe) -> tuple[bool, str]:
    """Whether llama.cpp may put weights in its extra CPU buffer types (AMX tiles, repacked
    layouts), and why: the rule of :func:`llama_extra_buffers`, with the probe passed in.

    probe: () -> (ok, detail), run only for a build with the AMX path (``AMX_INT8 = 1``); ok is
        None when the probe could not tell (its model did not load).
    """
    env = os.environ.get("DRAFTD_LLAMA_EXTRA_BUFTS", "").strip()
    if env in ("0", "1"):
        return env == "1", f"DRAFTD_LLAMA_EXTRA_BUFTS={env}"
    if env:
        raise EngineError(f"DRAFTD_LLAMA_EXTRA_BUFTS={env!r}: use 1 (llama.cpp's extra/AMX weight buffers on), "
                          f"0 (off), or leave it unset (probed)")
    if "AMX_INT8 = 1" not in system_info:
        return True, "no AMX path in this llama.cpp build"
    ok, detail = probe()
    if ok:
        return True, f"the AMX path works in this build ({detail})"
    if ok is None:
        return False, f"the AMX path of this llama.cpp build is unprobed ({detail}): the AVX-512 kernels run"
    return False, (f"the AMX matmul of this llama.cpp build faults ({detail}): the AVX-512 kernels run instead; "
                   f"scripts/install builds llama-cpp-python with the fix (-fno-dse -fno-tree-dse)")


def llama_extra_buffers(gguf: str | Path) -> tuple[bool, str]:
    """Decide, once per process, whether llama.cpp loads weights into its extra buffer types, and
    make every later load follow it (ours and ``llama_cpp.Llama``'s, whose defaults are patched).

    On a CPU with AMX, llama.cpp keeps Q4_0/Q4_1/Q8_0/K-quant weights in AMX tiles: measured on
    a Xeon with AMX (2 threads, SmolLM2-135M Q4_1), a one-token step takes 6.7 ms against 12.3 ms
    on the AVX-512 kernels. But GCC 12 at -O3 drops the stores that fill the tile configuration
    in ``ggml_tile_config_init`` (it does not see ``_tile_loadconfig`` read them), so the first
    batched matmul dies with a general-protection fault (ggml-org/llama.cpp#20824 reads like it).
    Whether this build has that bug is probed once in a child process on ``gguf`` (about a second)
    and cached per library file under :func:`decoder.models.cache_root`; a build without the AMX
    path is not probed. ``DRAFTD_LLAMA_EXTRA_BUFTS`` = ``1`` / ``0`` overrides.

    Returns:
        (use_extra_bufts, reason), logged once.
    """
    global _extra, _route
    L = _llama()
    with _init_lock:
        if _extra is None:
            info = L.llama_print_system_info().decode(errors="replace")
            probed: list[tuple[bool | None, str]] = []
            decided = extra_buffer_policy(info, lambda: probed.append(_probe_extra_buffers(Path(gguf))) or probed[0])
            if probed and probed[0][0] is None:
                return decided  # the probe could not tell: this load runs without them, the next probes again
            _extra = decided
            use = _extra[0]
            _route = use and "AMX_INT8 = 1" in info
            defaults = getattr(L.llama_model_default_params, "_draftd_defaults", L.llama_model_default_params)

            def model_params():
                p = defaults()
                p.use_extra_bufts = use
                return p

            model_params._draftd_defaults = defaults
            L.llama_model_default_params = model_params  # what llama_cpp.Llama calls too
            log.info("llama.cpp extra buffer types", use=use, reason=_extra[1])
        return _extra


def _probe_extra_buffers(gguf: Path) -> tuple[bool, str]:
    """(ok, detail) of :data:`_PROBE`, cached per llama.cpp CPU library file; ok None: unknown.

    The probe loads the packaged SmolLM2 GGUF when it is installed (Q4_1 weights, which the AMX
    path takes), else ``gguf``; a model of other weight types (F32) would not reach the AMX
    matmul, so its "ok" is not cached."""
    import json
    import signal
    import subprocess
    import sys

    import llama_cpp

    from decoder.models import cache_root, packaged_gguf

    libdir = Path(llama_cpp.__file__).parent / "lib"
    libs = sorted({p.resolve() for p in libdir.glob("libggml-cpu*")} or {p.resolve() for p in libdir.glob("*")})
    key = ";".join(f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in libs if p.is_file())
    cache = cache_root() / "llama-extra-buffers.json"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(key) if isinstance(known, dict) else None
    if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], bool):
        return entry[0], f"{entry[1]}, cached"
    packaged = None
    try:
        packaged = packaged_gguf("smollm2-135m")
    except Exception:  # noqa: BLE001 - not installed: probe on the model at hand
        pass
    model = packaged if packaged is not None and Path(packaged).is_file() else gguf
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE, str(model)], capture_output=True, timeout=120)
        faults = {-int(signal.SIGSEGV), -int(signal.SIGILL), -int(signal.SIGBUS)}
        ok = True if r.returncode == 0 else False if r.returncode in faults else None
        detail = (f"probe on {Path(model).name} decoded a batch" if r.returncode == 0 else
                  f"probe on {Path(model).name} killed by signal {-r.returncode}" if r.returncode < 0 else
                  f"probe on {Path(model).name} exited {r.returncode}")
    except subprocess.TimeoutExpired:
        ok, detail = None, "probe timed out"
    if ok and model != packaged:  # its weights may never reach the AMX matmul: proves nothing
        return None, f"{detail}, but the packaged model is not installed to probe the AMX matmul with"
    if ok is not None:  # a clear answer about the build (a fault, or the packaged model decoding), kept
        # (an interrupt, a kill or an abort says nothing about the build: retried next start)
        known = known if isinstance(known, dict) else {}
        known[key] = [ok, detail]
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(known))
            os.replace(tmp, cache)
        except OSError:
            tmp.unlink(missing_ok=True)
    return ok, detail


class LlamaCppSequence:
    """A request's slot (sequence 0) in a :class:`LlamaCppEngine`'s context."""

    def __init__(self, engine: "LlamaCppEngine"):
        self.engine = engine
        self.length = 0

    def forward(self, tokens: list[int], keep: int, hidden: bool = False):
        return self.engine._decode(self, tokens, keep, hidden)

    def truncate(self, length: int) -> None:
        if self.length > length:
            e = self.engine
            e._check_open()
            if not e.L.llama_memory_seq_rm(e.mem, 0, length, -1):
                raise EngineError(f"llama.cpp could not drop positions >= {length} of the sequence")
            self.length = length


KV_CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30}  # ggml.h's enum ggml_type (llama_cpp exports no BF16 name)


class LlamaCppEngine:
    """A GGUF model in llama.cpp.

    Args:
        path: the GGUF file (the packaged target, or the derived draft of
            :func:`decoder.gguf_export.derived_draft_gguf`).
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
        v_cache: element type of the V cache, one of :data:`KV_CACHE_TYPES` (K stays f16).
            ``"bf16"`` (the default) keeps a row's logits bit-identical whether it is verified in
            a block or decoded alone at every cache length: with f16 K and f16 V, llama.cpp's CPU
            flash attention decodes a one-row query over a KV view of 512 cells or more (from the
            257th cached token) with the cache split across threads and the partial softmaxes
            merged, a different summation order than the block's, so near-ties could flip and a
            served greedy output differ from plain decoding; with V in another type than K that
            one-row path is not taken. ``"f16"`` is llama.cpp's (and the bench peer's) default.

    Raises:
        EngineError: llama-cpp-python missing, or the file does not load.
        ValueError: ``v_cache`` not one of :data:`KV_CACHE_TYPES`.
    """

    name = "llamacpp"

    def __init__(self, path: str | Path, n_ctx: int | None = None, threads: int | None = None,
                 n_batch: int = 512, embeddings: bool = False, flash_attn: bool = True, v_cache: str = "bf16"):
        if v_cache not in KV_CACHE_TYPES:
            raise ValueError(f"v_cache={v_cache!r}: use one of {sorted(KV_CACHE_TYPES)}")
        L = self.L = _llama()
        self.path = Path(path)
        if not self.path.is_file():
            raise EngineError(f"GGUF file {str(path)!r} does not exist")
        self.extra_bufts, _ = llama_extra_buffers(self.path)
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = self.extra_bufts
        self.model = L.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self.model:
            raise EngineError(f"llama.cpp could not load {str(path)!r} (not a GGUF model it supports?)")
        train_ctx = int(L.llama_model_n_ctx_train(self.model))
        self.context_length = int(n_ctx or min(train_ctx, 8192))
        self.threads = int(threads or os.cpu_count() or 1)
        self.n_batch = int(n_batch)
        self.embeddings = bool(embeddings)
        self._emb_on = self.embeddings  # hidden-state extraction on the context now (llama_set_embeddings)
        cp = L.llama_context_default_params()
        cp.n_ctx = self.context_length
        cp.n_batch = cp.n_ubatch = self.n_batch
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.embeddings = self.embeddings
        cp.pooling_type = 0  # LLAMA_POOLING_TYPE_NONE: per-token hidden states
        cp.flash_attn_type = 1 if flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        self.flash_attn = bool(flash_attn)
        cp.type_v = KV_CACHE_TYPES[v_cache]
        self.v_cache = v_cache
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise EngineError(f"llama.cpp could not create a context of {self.context_length} tokens for {path}")
        self.mem = L.llama_get_memory(self.ctx)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.vocab_size = int(L.llama_vocab_n_tokens(self.vocab))
        self.hidden_size = int(L.llama_model_n_embd(self.model))
        eos = {int(L.llama_vocab_eos(self.vocab)), int(L.llama_vocab_eot(self.vocab))}
        self.eos_ids = frozenset(t for t in eos if t >= 0)
        self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        self._loras: dict[str, object] = {}
        self.lora: str | None = None  # the adapter key now set on the context
        self._closed = False
        self._busy = threading.Lock()  # held by a decode; close() waits for it
        self._offset_lora = None  # a split Q4_1 file's offset adapter, under every forward
        self.offset_lora: Path | None = None
        split = self._meta_str(SPLIT_KEY)
        if split is not None:
            self._apply_offset_lora(self.path.parent / split)

    def _meta_str(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = self.L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", "replace")

    def _apply_offset_lora(self, path: Path) -> None:
        """A split Q4_1 model (:func:`decoder.gguf_export.q4_1_split_gguf`) is Q4_0 blocks plus
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

    def start(self) -> LlamaCppSequence:
        self._check_open()
        # Metadata only with flash attention (zeroing the buffers cost 19 ms a request at 8192 tokens;
        # masked cells never reach its softmax); without it a stale cell holding inf/NaN (an f16
        # overflow) turned a later request's logits to NaN (QA), so the buffers are zeroed there.
        self.L.llama_memory_clear(self.mem, not self.flash_attn)
        return LlamaCppSequence(self)

    def _decode(self, seq: LlamaCppSequence, tokens: list[int], keep: int, hidden: bool):
        with self._busy:  # a close() from another thread waits for this decode instead of freeing under it
            return self._decode_locked(seq, tokens, keep, hidden)

    def _decode_locked(self, seq: LlamaCppSequence, tokens: list[int], keep: int, hidden: bool):
        self._check_open()
        L, n = self.L, len(tokens)
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
            for i, t in enumerate(chunk):
                b.token[i] = int(t)
                b.pos[i] = seq.length + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                out = c0 + i >= first_out
                b.logits[i] = 1 if out else 0
                outs += out
            rc = llama_call(L.llama_decode, self.ctx, b)
            if rc != 0:
                raise EngineError(f"llama_decode returned {rc} (1: no KV slot; <0: error) at position {seq.length}")
            seq.length += len(chunk)
            if outs:
                if self._emb_on:
                    # llama.cpp then outputs every token of the batch, whatever b.logits says
                    # (llama-batch.cpp: "embeddings required but some input tokens were not marked
                    # as outputs -> overriding"), so llama_get_logits holds len(chunk) rows: pick
                    # the wanted ones by their batch position, as llama_get_embeddings_ith does.
                    want = range(len(chunk) - outs, len(chunk))
                    rows.append(np.stack([self._row(L.llama_get_logits_ith(self.ctx, i), self.vocab_size, i)
                                          for i in want]))
                    if hidden:
                        hs.append(np.stack([self._row(L.llama_get_embeddings_ith(self.ctx, i), self.hidden_size, i)
                                            for i in want]))
                else:
                    rows.append(np.ctypeslib.as_array(L.llama_get_logits(self.ctx),
                                                      shape=(outs, self.vocab_size)).copy())
        logits = torch.from_numpy(rows[0] if len(rows) == 1 else np.concatenate(rows))
        if hidden:
            return logits, torch.from_numpy(np.concatenate(hs))
        return logits

    @staticmethod
    def _row(ptr, width: int, i: int) -> np.ndarray:
        if not ptr:
            raise EngineError(f"llama.cpp returned no output for batch position {i}")
        return np.ctypeslib.as_array(ptr, shape=(width,)).copy()

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
            raise EngineError(f"llama_set_adapters_lora({key!r}) returned {rc}")

    def drop_lora(self, key: str) -> None:
        """Free an adapter that is not applied."""
        if key == self.lora:
            raise EngineError(f"adapter {key!r} is in use; set another first")
        self._check_open()
        ad = self._loras.pop(key, None)
        if ad:
            self.L.llama_adapter_lora_free(ad)

    @property
    def loras(self) -> list[str]:
        return list(self._loras)

    def describe(self) -> dict:
        return {"engine": self.name, "model": self.path.name, "device": "cpu", "threads": self.threads,
                "n_ctx": self.context_length, "v_cache": self.v_cache, "lora": self.lora,
                "extra_buffer_types": self.extra_bufts}

    def close(self) -> None:
        with self._busy:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._closed:
            return
        self._closed = True
        L = self.L
        L.llama_batch_free(self._batch)
        L.llama_free(self.ctx)
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


# ---- choosing one --------------------------------------------------------------------------------
@dataclass
class EngineChoice:
    """The engine a decoder runs its target (and draft) on, and why."""

    name: str  # "torch" | "llamacpp"
    reason: str
    target: Engine | None = None  # None: the decoder wraps its torch target itself
    draft: Engine | None = None  # the draft on llama.cpp (the derived draft's GGUF), else None


@contextlib.contextmanager
def torch_threads_for(engine):
    """While decoding on a llama.cpp ``engine``: torch's intra-op threads at 1, restored after.

    On llama.cpp the decoder's own torch work per step is vector math over a vocabulary row or
    a few (processing, sampling, the acceptance test); with torch's default threads, its OpenMP
    workers kept spinning after each of those small ops and took the cores from llama.cpp's
    thread pool: measured (2 cores, Xeon), our plain decoding 58-77 tokens/s against 148-157 with
    one torch thread, llama.cpp's own generation 146 in the same build. torch's thread count is
    process-wide: a process that also trains in torch (the demo) chooses its own.
    """
    if not isinstance(engine, LlamaCppEngine) or torch.get_num_threads() == 1:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def target_gguf(target: str) -> Path | None:
    """The GGUF behind a target reference: a built-in name's packaged file (``name@FORMAT``: the
    packaged file requantised, :func:`decoder.models.packaged_target`), or a ``.gguf`` path; None
    for anything else (a transformers directory or hub id)."""
    from decoder.models import packaged_target

    gguf = packaged_target(target)
    if gguf is not None:
        return gguf
    p = Path(target).expanduser()
    return p if p.suffix == ".gguf" and p.is_file() else None


def choose_engine(choice: str, target: str, device: str = "cpu", draft: str = "layers:0-3",
                  threads: int | None = None, embeddings: bool = False) -> EngineChoice:
    """Resolve ``models.engine`` for a target.

    ``auto``: llama.cpp when the target is a GGUF (a built-in name or a ``.gguf`` path), the
    device is the CPU and llama-cpp-python imports; torch otherwise. ``llamacpp`` insists (and
    raises where it cannot); ``torch`` never builds a llama.cpp context. On llama.cpp a derived
    draft (``layers:<spec>``) runs there too, from a GGUF of those blocks
    (:func:`decoder.gguf_export.derived_draft_gguf`, written once and cached).

    Raises:
        EngineError: ``llamacpp`` asked for a non-GGUF target, a GPU device, or without
            llama-cpp-python; an unknown choice.
    """
    if choice not in ENGINES:
        raise EngineError(f"engine {choice!r}: use one of {ENGINES}")
    if choice == "torch":
        return EngineChoice("torch", "asked for (models.engine=torch)")
    gguf = target_gguf(target)
    why_not = None
    if gguf is None:
        why_not = f"target {target!r} is not a GGUF file"
    elif device != "cpu":
        why_not = f"device {device!r} (llama.cpp is used here for CPU serving only)"
    elif not llamacpp_available():
        why_not = "llama-cpp-python is not installed (scripts/install builds it)"
    if why_not:
        if choice == "llamacpp":
            raise EngineError(f"--engine llamacpp: {why_not}; use --engine torch or auto")
        return EngineChoice("torch", f"auto: {why_not}")
    tgt = LlamaCppEngine(gguf, threads=threads, embeddings=embeddings)
    dr = None
    if draft.startswith("layers:"):
        from decoder.gguf_export import derived_draft_gguf
        from decoder.models import parse_layers

        layers = parse_layers(draft.split(":", 1)[1], _block_count(tgt))
        dr = LlamaCppEngine(derived_draft_gguf(gguf, layers), n_ctx=tgt.context_length, threads=threads)
    elif draft == "self":  # its own context: one sequence per context
        dr = LlamaCppEngine(gguf, n_ctx=tgt.context_length, threads=threads)
    reason = ("asked for (models.engine=llamacpp)" if choice == "llamacpp"
              else f"auto: GGUF target {gguf.name} on CPU, llama-cpp-python installed")
    return EngineChoice("llamacpp", reason, tgt, dr)


def _block_count(engine: LlamaCppEngine) -> int:
    return int(engine.L.llama_model_n_layer(engine.model))
