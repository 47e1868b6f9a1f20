"""Where llama.cpp's AMX tiles overtake the per-row kernel, measured once per host.

On a CPU with AMX, ``scripts/patches/ggml-amx-few-rows.patch`` runs a matmul of up to
``GGML_AMX_VNNI_MAX_ROWS`` activation rows (a verification's γ + 1 rows, a small decode batch)
through the one-row AVX512-VNNI kernel once per row while each column block's weights are in
cache, and more rows through 32-row AMX tiles, whose weights are unpacked once per call. The
per-row kernel adds each row's whole arithmetic; the tiles cost a fixed unpacking and little per
row. Where the two cross moves with the CPU and with the threads (bench/RESULTS.md, "Twenty-third
session", has two AMX Xeons that differ). Both paths give every row the same bits (int8 products
summed in int32, then the same float scaling; tests/decoder/test_engines.py checks a verified row
against the row decoded alone at 2 to 9 rows), so the setting changes what a step costs, never
what it computes.

:func:`apply_amx_rows` measures it: two child processes, one per kernel (``GGML_AMX_VNNI_MAX_ROWS``
16 and 1), each time a decode of n = 1..9 rows after 256 cached tokens at each thread count
1..min(cores, 4) (median of :data:`REPS`); per thread count it keeps the largest row count for the
per-row kernel that minimises the summed cost over n = 2..9 (:func:`best_max_rows`), and sets
``GGML_AMX_VNNI_MAX_ROWS`` to the list ("a,b,...": a at 1 thread, b at 2, the last one for more
threads) in this process's environment before llama.cpp's first matmul reads it. Cached per
llama.cpp CPU library and CPU under :func:`decoder.models.packaged.cache_root` (``amx-rows.json``),
one process measuring at a time (a lock file beside it). Not used, and measured again at the next
start: a measurement whose two one-row steps (the same kernel) differ by more than
:data:`NOISE_MAX`, or beside other work (other processes above :data:`BUSY_MAX` of the CPUs). It is
measured on the packaged SmolLM2 Q4_1 GGUF, whose weights the AMX path takes; without it the
patch's default stands. A ``GGML_AMX_VNNI_MAX_ROWS`` set by the user is kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

ENV = "GGML_AMX_VNNI_MAX_ROWS"
DEFAULT = 8  # the patch's default where nothing is set
MAX_N = 9  # rows measured: a verification at the controller's γ_max = 8
REPS = 7
CACHED = 256
NOISE_MAX = 0.2  # the two children's one-row steps (the same kernel) may differ by this much
BUSY_MAX = 0.25  # other processes' share of the CPUs during the measurement above which it is not used
CHILD_TIMEOUT_S = 120
CACHE_NAME = "amx-rows.json"
MEASURE_VERSION = 1

_CHILD = """
import json, statistics, sys
from decoder.engines.amx_rows import time_rows
from decoder.engines.llamacpp import LlamaCppEngine
gguf, threads, reps, cached, max_n = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
out = {}
for th in threads:
    eng = LlamaCppEngine(gguf, n_ctx=1024, threads=int(th))
    seq = eng.start()
    seq.forward([100 + i % 1000 for i in range(cached)], 1)
    ms = time_rows(seq, cached, range(1, max_n + 1), reps)
    seq.release()
    eng.close()
    out[th] = {str(n): statistics.median(v) for n, v in ms.items()}
print(json.dumps(out))
"""


def time_rows(seq, cached: int, ns, reps: int) -> dict[int, list[float]]:
    """ms of ``reps`` decodes of n rows (each n in ``ns``, interleaved) on ``seq``, a sequence
    holding ``cached`` tokens, cut back to them after each; logits at every row, as a verification."""
    ms: dict[int, list[float]] = {n: [] for n in ns}
    for _ in range(reps):
        for n in ms:
            t0 = time.perf_counter()
            seq.forward([5 + j for j in range(n)], n)
            ms[n].append((time.perf_counter() - t0) * 1e3)
            seq.truncate(cached)
    return ms


def best_max_rows(per_row: dict[int, float], tiles: dict[int, float], max_n: int = MAX_N) -> int:
    """The ``GGML_AMX_VNNI_MAX_ROWS`` k in 1..``max_n`` that minimises Σ_{n=2..max_n} cost_k(n),
    cost_k(n) = ``per_row[n]`` for n <= k (the per-row kernel) else ``tiles[n]`` (ms of a decode of
    n rows on each path); the largest such k on a tie. One row always takes the per-row kernel."""
    best_k, best = 1, None
    for k in range(1, max_n + 1):
        total = sum(per_row[n] if n <= k else tiles[n] for n in range(2, max_n + 1))
        if best is None or total <= best:
            best_k, best = k, total
    return best_k


def _measure(gguf: Path, threads: list[int]) -> tuple[dict[str, dict[int, dict[int, float]]] | None, str]:
    """({"per_row": {threads: {n: ms}}, "tiles": ...}, "") from the two children, or (None, why)."""
    root = str(Path(__file__).resolve().parents[2])
    out: dict[str, dict[int, dict[int, float]]] = {}
    for name, value in (("per_row", "16"), ("tiles", "1")):
        env = dict(os.environ, **{ENV: value}, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        try:
            r = subprocess.run([sys.executable, "-c", _CHILD, str(gguf), ",".join(map(str, threads)), str(REPS),
                                str(CACHED), str(MAX_N)], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            return None, f"the {name} measurement timed out"
        if r.returncode != 0:
            tail = (r.stderr or "").strip().splitlines()[-1:] or [f"exit {r.returncode}"]
            return None, f"the {name} measurement failed ({tail[0][:200]})"
        try:
            raw = json.loads(r.stdout.strip().splitlines()[-1])
            out[name] = {int(t): {int(n): float(ms) for n, ms in v.items()} for t, v in raw.items()}
        except (ValueError, IndexError, AttributeError) as e:
            return None, f"the {name} measurement printed no result ({e})"
    return out, ""


def _key(gguf: Path, threads: list[int], identity: str) -> str:
    info = _cpuinfo()
    cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "?")
    model = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model\t")), "?")
    return f"v{MEASURE_VERSION};{identity};{cpu};model {model};{gguf.name};threads {','.join(map(str, threads))}"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _decide(meas: dict[str, dict[int, dict[int, float]]], threads: list[int]) -> tuple[list[int] | None, str]:
    """Per thread count the best k (:func:`best_max_rows`), or (None, why) where the two children's
    one-row steps (the same kernel) differ by more than :data:`NOISE_MAX` (host load moved them)."""
    ks, parts = [], []
    for t in threads:
        a, b = meas["per_row"][t], meas["tiles"][t]
        if max(a[1], b[1]) / min(a[1], b[1]) - 1 > NOISE_MAX:
            return None, (f"noisy: the one-row step read {a[1]:.2f} and {b[1]:.2f} ms at {t} thread(s) in the two "
                          f"measurements (the same kernel); measured again at the next start")
        k = best_max_rows(a, b)
        ks.append(k)
        costs = ", ".join(f"{n} {a[n]:.1f}/{b[n]:.1f}" for n in range(2, MAX_N + 1))
        parts.append(f"{t} thread(s): the per-row kernel up to {k} row(s), the tiles beyond (ms a decode of n rows, "
                     f"per-row/tiles: {costs})")
    return ks, "; ".join(parts)


def _valid(setting: Any) -> bool:
    """A cached setting as this module writes it: 1 to 16 comma-separated ints in 1..:data:`MAX_N`."""
    if not isinstance(setting, str) or not re.fullmatch(r"\d+(,\d+){0,15}", setting):
        return False
    return all(1 <= int(v) <= MAX_N for v in setting.split(","))


def _others_busy(j0, c0, j1, c1, seconds: float) -> float | None:
    """:func:`decoder.hostload.others_share` with this process's measuring children counted as its
    own (their CPU time from ``os.times()`` snapshots ``c0``/``c1``), or None where unknown."""
    from decoder.hostload import others_share

    if j0 is None or j1 is None:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    children = round(((c1.children_user + c1.children_system) - (c0.children_user + c0.children_system)) * hz)
    return others_share(j0, (j1[0], j1[1] + children), seconds, os.cpu_count() or 1, hz)


def _read(cache: Path) -> dict:
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _write(cache: Path, known: dict) -> None:
    """Write ``known`` to ``cache`` whole (a temporary file, then a rename); a cache that cannot be
    written (read-only, not a directory) costs only the caching."""
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(known))
        os.replace(tmp, cache)
    except OSError as e:
        log.warning("amx_rows_not_cached", cache=str(cache), error=str(e))
        with contextlib.suppress(OSError):  # a read-only file system answers EROFS, not ENOENT
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def _measuring_lock(cache: Path):
    """One process measures at a time (two starting at once would time each other's load): an
    exclusive ``flock`` on ``<cache>.lock``; none where it cannot be made."""
    fd = None
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(cache.with_suffix(".lock"), os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def apply_amx_rows(gguf: Path, identity: str = "") -> dict[str, Any]:
    """Set ``GGML_AMX_VNNI_MAX_ROWS`` for this process from this host's measurement (cached), unless
    it is set already. Call before llama.cpp's first matmul (``llama_extra_buffers`` does, where
    the AMX path runs). Measured on the packaged SmolLM2 Q4_1 GGUF (weights the AMX path takes);
    ``gguf`` is named only where that model is missing; ``identity``, the llama.cpp build's
    (``decoder.engines.llamacpp_lib.cpu_backend_identity``), keys the cache. Returns ``{"setting",
    "source", "reason"}`` (and ``ms``): ``source`` one of "environment", "cached", "measured",
    "default" (no packaged model, a failed, noisy or busy measurement: the patch's default, 8 rows,
    measured again at the next start). Never raises."""
    if os.environ.get(ENV) is not None:
        return {"setting": os.environ[ENV], "source": "environment", "reason": f"{ENV} set in the environment"}
    from decoder.models.packaged import cache_root, packaged_gguf

    try:
        model = Path(packaged_gguf("smollm2-135m"))
    except Exception:  # noqa: BLE001 - not installed
        model = None
    if model is None or not model.is_file():  # another model's weights may never reach the AMX matmul
        return {"setting": str(DEFAULT), "source": "default",
                "reason": f"the packaged model is not installed to measure with ({Path(gguf).name} served as built)"}
    threads = list(range(1, min(os.cpu_count() or 1, 4) + 1))
    key, cache = _key(model, threads, identity), cache_root() / CACHE_NAME
    with _measuring_lock(cache):  # a process that waited here reads what the other one measured
        entry = _read(cache).get(key)
        if isinstance(entry, dict) and _valid(entry.get("setting")):
            os.environ[ENV] = entry["setting"]
            return {**entry, "source": "cached"}
        entry = _measure_and_decide(model, threads)
        if entry.get("source") == "default":
            log.warning("amx_rows_not_measured", reason=entry["reason"], default=DEFAULT)
            return entry
        os.environ[ENV] = entry["setting"]
        _write(cache, {**_read(cache), key: entry})
    log.info("amx_rows_measured", setting=entry["setting"], reason=entry["reason"])
    return {**entry, "source": "measured"}


def _measure_and_decide(model: Path, threads: list[int]) -> dict[str, Any]:
    """The cache entry of a measurement ({"setting", "reason", "model", "ms"}), or a default answer
    ({"source": "default", ...}) where it failed, was noisy, or ran beside other work."""
    from decoder.hostload import cpu_jiffies

    j0, c0, t0 = cpu_jiffies(), os.times(), time.perf_counter()
    meas, why = _measure(model, threads)
    busy = _others_busy(j0, c0, cpu_jiffies(), os.times(), time.perf_counter() - t0)
    ks, reason = _decide(meas, threads) if meas is not None else (None, why)
    if ks is not None and busy is not None and busy > BUSY_MAX:
        ks, reason = None, (f"the measurement ran beside other work (other processes used {busy:.0%} of the CPUs, "
                            f"above {BUSY_MAX:.0%}); measured again at the next start")
    ms = {k: {str(t): {str(n): round(v, 3) for n, v in d.items()} for t, d in by_t.items()}
          for k, by_t in (meas or {}).items()}
    if ks is None:
        return {"setting": str(DEFAULT), "source": "default", "reason": reason, "ms": ms}
    return {"setting": ",".join(map(str, ks)), "reason": reason, "model": model.name, "ms": ms}
