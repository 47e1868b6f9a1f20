"""llama.cpp's C plumbing, shared by every llama.cpp user in the process: llama-cpp-python's
low-level :func:`bindings` (initialised once), :func:`llama_call` (the one thread llama.cpp
computes on while AMX tiles are in use), and :func:`llama_extra_buffers` (whether weights go to
llama.cpp's extra buffer types, probed once per build)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from pathlib import Path

import structlog

from decoder.engines.base import EngineError

log = structlog.get_logger("decoder.engines.llamacpp_lib")


def llamacpp_available() -> bool:
    """True when llama-cpp-python can be imported (it is a dependency; a broken build may lack it)."""
    return importlib.util.find_spec("llama_cpp") is not None


_init_lock = threading.Lock()
_initialised = False
_log_cb = None  # the ctypes log callback must outlive every call into llama.cpp


def bindings():
    """llama-cpp-python's low-level bindings, initialised once, with llama.cpp's logging off
    (``DRAFTD_LLAMA_LOG=1`` keeps it). Load models after :func:`llama_extra_buffers`."""
    global _initialised, _log_cb
    try:
        import llama_cpp.llama_cpp as L
    except ImportError as e:  # pragma: no cover - depends on the install
        raise EngineError(f"the llama.cpp engine needs llama-cpp-python ({e}); run scripts/install, "
                          f"or use --engine torch") from e
    with _init_lock:
        if not _initialised:
            if os.environ.get("DRAFTD_LLAMA_LOG") != "1":
                _log_cb = L.llama_log_callback(lambda level, text, data: None)
                L.llama_log_set(_log_cb, None)
            L.llama_backend_init()
            _initialised = True
    return L


_extra: tuple[bool, str] | None = None  # this process's decision (llama_extra_buffers)
_route = False  # llama_call runs llama.cpp's compute on its own thread (AMX tiles in use)
_amx_rows: dict | None = None  # decoder.engines.amx_rows.apply_amx_rows's result where the AMX path runs
_llama_q = None  # the llama.cpp thread's work queue (_llama_queue)
_llama_ident: int | None = None


def amx_rows() -> dict | None:
    """This process's ``GGML_AMX_VNNI_MAX_ROWS`` decision (:func:`decoder.engines.amx_rows.apply_amx_rows`:
    setting, source, reason), or None where llama.cpp's AMX path does not run."""
    return _amx_rows


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
    and cached per library file under :func:`decoder.models.packaged.cache_root`; a build without the AMX
    path is not probed. ``DRAFTD_LLAMA_EXTRA_BUFTS`` = ``1`` / ``0`` overrides.

    Returns:
        (use_extra_bufts, reason), logged once.
    """
    global _extra, _route, _amx_rows
    L = bindings()
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
            if _route:  # before the first matmul reads it: where the AMX tiles overtake the per-row kernel
                from decoder.engines.amx_rows import apply_amx_rows

                _amx_rows = apply_amx_rows(Path(gguf), cpu_backend_identity())
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

    from decoder.models.packaged import cache_root, packaged_gguf

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
            try:  # a read-only file system answers EROFS, not ENOENT: the cache is lost, not the load
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
    return ok, detail



# ---- persistent ggml threadpools, one per shape, shared by the contexts --------------------------

POLL_DEFAULT = 50  # ggml_threadpool_params_default's polling level, llama-server's default (--poll)


class _ThreadpoolParams(ctypes.Structure):
    """``struct ggml_threadpool_params`` (ggml.h; GGML_MAX_N_THREADS = 512)."""

    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


_pool_fns = None  # (params_default, new, free, attach, detach) or False where the build lacks them


# the environment switches of scripts/patches: each changes what a step costs
PATCH_SWITCHES = ("GGML_AMX_VNNI_MAX_ROWS", "GGML_FA_BF16V_BLOCKED", "GGML_X86_TILED")
_ON_UNLESS_0 = ("GGML_FA_BF16V_BLOCKED", "GGML_X86_TILED")  # on unless the value starts with 0


def patch_switches(environ=None) -> dict[str, tuple[int, ...] | bool]:
    """The patches' switches as the patched ggml reads them (once per process, at its first
    matmul / attention): ``GGML_AMX_VNNI_MAX_ROWS`` as a tuple, one entry per thread count (1, 2,
    ...; the last one for more threads), each comma-separated field as C's ``atoi`` reads it
    (leading digits, after an optional sign; anything else 0), at least 1, at most 16 fields,
    default ``(8,)`` (:mod:`decoder.engines.amx_rows` sets it per host); ``GGML_FA_BF16V_BLOCKED``
    and ``GGML_X86_TILED`` off only when the value starts with ``0``. So "abc" and "1" read the
    same, as do unset and "8"."""
    import re

    env = os.environ if environ is None else environ
    raw = env.get("GGML_AMX_VNNI_MAX_ROWS")

    def atoi(field: str) -> int:  # glibc's: (int) strtol(field, NULL, 10), C locale blanks and digits only
        m = re.match(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", field)
        if not m:
            return 0
        v = max(min(int(m.group(1)), 2**63 - 1), -(2**63))  # strtol saturates at the long's range
        return (v + 2**31) % 2**32 - 2**31  # the cast to a 32-bit int wraps

    rows = (8,) if raw is None else tuple(max(1, atoi(f)) for f in raw.split(",")[:16])
    return {"GGML_AMX_VNNI_MAX_ROWS": rows, **{k: not (env.get(k) or "1").startswith("0") for k in _ON_UNLESS_0}}


def cpu_backend_identity() -> str:
    """What decides llama.cpp's step costs besides the CPU and the model: a digest (16 hex) of the
    installed CPU backend libraries' bytes (another build, patched or not, is another digest) and
    the patches' switches as set in this environment (``NAME=value``, unset ones left out). For
    keys of cached cost measurements (``decoder.models.formats.measure_formats``); "" when
    llama-cpp-python is not installed."""
    import hashlib

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.origin:
        return ""
    # LLAMA_CPP_LIB_PATH: llama-cpp-python loads the libraries from there instead
    libdir = Path(os.environ.get("LLAMA_CPP_LIB_PATH") or Path(spec.origin).parent / "lib")
    libs = sorted({p.resolve() for p in libdir.glob("libggml-cpu*") if p.is_file()})
    if not libs:
        return ""
    h = hashlib.sha256()
    for lib in libs:
        h.update(lib.read_bytes())
    sw, default = patch_switches(), patch_switches({})
    env = ",".join(f"{k}={','.join(map(str, v)) if isinstance(v, tuple) else int(v)}"
                   for k, v in sw.items() if v != default[k])
    return h.hexdigest()[:16] + (f";{env}" if env else "")


def _threadpool_fns():
    """ggml's threadpool calls and llama.cpp's attach/detach through ctypes (llama-cpp-python binds
    neither), from the libraries it loaded; False where a symbol is missing."""
    global _pool_fns
    with _init_lock:
        if _pool_fns is None:
            import llama_cpp

            libdir = Path(llama_cpp.__file__).parent / "lib"
            try:
                base = ctypes.CDLL(_mapped(libdir, "libggml-base"))
                cpu = ctypes.CDLL(_mapped(libdir, "libggml-cpu"))
                lib = ctypes.CDLL(_mapped(libdir, "libllama"))
                base.ggml_threadpool_params_default.restype = _ThreadpoolParams
                base.ggml_threadpool_params_default.argtypes = [ctypes.c_int]
                cpu.ggml_threadpool_new.restype = ctypes.c_void_p
                cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(_ThreadpoolParams)]
                cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
                lib.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
                lib.llama_detach_threadpool.argtypes = [ctypes.c_void_p]
                _pool_fns = (base.ggml_threadpool_params_default, cpu.ggml_threadpool_new, cpu.ggml_threadpool_free,
                             lib.llama_attach_threadpool, lib.llama_detach_threadpool)
            except (OSError, AttributeError) as e:
                log.info("llama.cpp threadpool unavailable", error=str(e))
                _pool_fns = False
    return _pool_fns


def _mapped(libdir: Path, stem: str) -> str:
    """The path under which this process already mapped library ``stem`` (``libggml-cpu``) from
    ``libdir``: the wheel ships each library as separate copies (``.so``, ``.so.0``, ``.so.0.x.y``),
    and a second copy loaded by another name is a second instance with its own globals (a pool made
    by one and computed on by the other gave NaN logits). Raises OSError where none is mapped."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if path.startswith(str(libdir) + "/") and Path(path).name.startswith(stem + ".so"):
            return path
    raise OSError(f"{stem} is not loaded from {libdir}")


def poll_level() -> int:
    """The threadpools' polling level: ``DRAFTD_LLAMA_POLL`` when set, else :data:`POLL_DEFAULT`.

    Raises:
        EngineError: the variable is not a whole number from 0 to 100.
    """
    env = os.environ.get("DRAFTD_LLAMA_POLL", "").strip()
    if not env:
        return POLL_DEFAULT
    if not env.isdigit() or int(env) > 100:
        raise EngineError(f"DRAFTD_LLAMA_POLL={env!r}: ggml's polling level is a whole number from 0 (no polling) to "
                          f"100; unset it for {POLL_DEFAULT}, llama-server's default")
    return int(env)


class SharedPool:
    """One ggml threadpool (``handle``) and the contexts attached to it (``users``); ``lock`` is
    held around every computation on it (:meth:`LlamaCppEngine._llama_decode`): two graphs computed
    on one pool at once would share its workers."""

    __slots__ = ("handle", "key", "lock", "users")

    def __init__(self, handle, key: tuple[int, int]):
        self.handle, self.key, self.lock, self.users = handle, key, threading.Lock(), 0


_pools: dict[tuple[int, int], SharedPool] = {}  # (n_threads, poll) -> the process's pool of that shape


def attach_threadpool(ctx, n_threads: int, poll: int | None = None) -> SharedPool | None:
    """The process's persistent ggml threadpool of ``n_threads`` (made on first use), attached to
    llama.cpp context ``ctx``, as llama-server attaches one (common_threadpools::init); returns it
    for :func:`free_threadpool`, or None where it cannot be made (the context then keeps
    llama.cpp's default: a pool created and joined inside every graph computation).

    Why a pool: without one, each ``llama_decode`` starts ``n_threads - 1`` new worker threads and
    joins them; on a small CPU where another thread is runnable (the event loop writing a streamed
    chunk, the client reading it) a new worker waits to be scheduled while thread 0 spins at the
    graph's first barrier. A pool's workers stay on their cores, polling for the next graph
    (``poll``: 0 no polling, 100 most; default :data:`POLL_DEFAULT`, ``DRAFTD_LLAMA_POLL``
    overrides).

    Why one pool for every context of the same ``n_threads`` and ``poll`` (the target and the
    draft): a pool's workers poll for a while after each graph, so with a pool per context the
    target's workers spun on the cores while the draft computed, and the draft's while the target
    verified, and draft speculation at 2 threads cost several times what it costs with one pool
    (bench/RESULTS.md, "Twenty-fifth session"). One pool's
    workers take whichever graph comes next; its ``lock`` keeps two at a time off it.

    Raises:
        ValueError: ``n_threads`` below 1 or ``poll`` outside 0-100.
        EngineError: ``poll`` None and ``DRAFTD_LLAMA_POLL`` malformed (:func:`poll_level`).
    """
    if n_threads < 1:
        raise ValueError(f"n_threads={n_threads}: a threadpool needs at least 1 thread")
    poll = poll_level() if poll is None else poll
    if not 0 <= poll <= 100:
        raise ValueError(f"poll={poll}: ggml's polling level is 0 (none) to 100 (DRAFTD_LLAMA_POLL)")
    fns = _threadpool_fns()
    if not fns:
        return None
    params_default, new, _free, attach, _detach = fns
    key = (int(n_threads), int(poll))
    with _init_lock:
        pool = _pools.get(key)
        if pool is None:
            p = params_default(int(n_threads))
            p.poll = int(poll)
            handle = new(ctypes.byref(p))
            if not handle:
                return None
            pool = _pools[key] = SharedPool(handle, key)
        pool.users += 1
    attach(ctx, pool.handle, None)  # None: the same pool for batches (llama_context::attach_threadpool)
    return pool


def free_threadpool(ctx, pool: SharedPool | None) -> None:
    """Detach ``pool`` from ``ctx`` (None: a context already freed) and free the pool once no
    context uses it; None ``pool``: nothing."""
    if pool is None:
        return
    fns = _threadpool_fns()
    if ctx is not None:
        with pool.lock:  # not under a computation on it
            fns[4](ctx)
    with _init_lock:
        pool.users -= 1
        if pool.users > 0:
            return
        if _pools.get(pool.key) is pool:
            del _pools[pool.key]
    with pool.lock:
        fns[2](pool.handle)
