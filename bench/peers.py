"""llama-server, the peer `bench/serve_bench.py --peer` measures draftd serve against: built once
from the llama.cpp that the pinned llama-cpp-python sdist vendors, cached like the wheel; its
command line; a running instance on a free loopback port.

For benchmarks only: nothing in draftd's install, CI or ``daemonctl`` needs it.

The build (:func:`llama_server_binary`):

- source: the sdist ``llama-cpp-python==<pin>`` of ``pyproject.toml`` (the same one
  ``scripts/install`` builds the wheel from), fetched once with ``pip download`` into
  ``<cache>/sdist`` and unpacked into a temporary directory; its ``vendor/llama.cpp`` is
  configured with CMake (Ninja when present) and only the ``llama-server`` target is built;
- flags: Release, CPU only (``GGML_NATIVE``: this CPU's instructions), static (one file), no
  CURL / OpenSSL (``LLAMA_CURL=OFF``, ``LLAMA_OPENSSL=OFF``: nothing is downloaded by the server),
  no web UI download (``LLAMA_USE_PREBUILT_UI=OFF``, ``LLAMA_BUILD_UI=OFF``), and the same ggml
  settings as the wheel ``scripts/install`` builds: ``GGML_OPENMP=OFF`` and ``-fno-dse
  -fno-tree-dse`` (without them GCC 12 drops the AMX tile configuration stores: a fault at the
  first batched matmul on an AMX CPU), so both sides run the same kernels. The server target
  links llama.cpp's multimodal library (``mtmd``) whatever the options: it is compiled, never
  loaded (no ``--mmproj``);
- cache: ``<cache>/bin/llama-server-<version>-<BUILD_TAG>-cpu<cpu_key>/llama-server``, where
  ``<cache>`` is ``$DRAFTD_CACHE_DIR`` or ``$XDG_CACHE_HOME/draftd`` or ``~/.cache/draftd`` (the
  root ``scripts/install`` keeps its wheels under) and ``cpu_key`` a digest of the CPU's flags
  (a native build is not reused on another CPU). About 5-8 minutes on 2 shared cores, once.

Usage::

    .venv/bin/python bench/peers.py            # build (or find) it; prints its path and `--help`'s speculation types
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# what the cached binary was built with, besides the sdist version and the CPU (the cache key)
BUILD_TAG = "nodse-noomp-static"
PROGRESS_EVERY_S = 20.0  # seconds between two progress lines of the build
say = functools.partial(print, file=sys.stderr, flush=True)  # progress lines on stderr, unbuffered (the build runs for minutes)


def pinned_version(pyproject: Path = REPO / "pyproject.toml") -> str:
    """The llama-cpp-python version ``pyproject.toml`` pins (``llama-cpp-python==X``).

    Raises:
        ValueError: no pin in the file.
    """
    m = re.search(r"llama-cpp-python==([0-9][0-9A-Za-z.]*)", pyproject.read_text(encoding="utf-8"))
    if not m:
        raise ValueError(f"{pyproject}: no llama-cpp-python==X pin")
    return m.group(1)


def cache_base() -> Path:
    """The draftd cache root: ``$DRAFTD_CACHE_DIR``, else ``$XDG_CACHE_HOME/draftd``, else
    ``~/.cache/draftd`` (as ``scripts/install``)."""
    if os.environ.get("DRAFTD_CACHE_DIR"):
        return Path(os.environ["DRAFTD_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "draftd"


def cpu_key(cpuinfo: str | None = None) -> str:
    """First 10 hex of sha256 over the sorted CPU flags (``/proc/cpuinfo``'s first ``flags``
    line; the machine name where there is none): a native build is keyed by the instructions
    it may use."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            import platform

            cpuinfo = f"flags : {platform.machine()} {platform.processor()}"
    m = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", cpuinfo, re.M)
    flags = " ".join(sorted(set((m.group(1) if m else cpuinfo).split())))
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def server_path(version: str | None = None, cpu: str | None = None) -> Path:
    """Where the cached ``llama-server`` of ``version`` (default: the pin) for ``cpu`` (default:
    this CPU's :func:`cpu_key`) lives; it may not exist yet."""
    version = version or pinned_version()
    cpu = cpu or cpu_key()
    return cache_base() / "bin" / f"llama-server-{version}-{BUILD_TAG}-cpu{cpu}" / "llama-server"


def cmake_configure_args(src: Path, build: Path, generator: str | None = None) -> list[str]:
    """The ``cmake`` configure command for ``llama-server`` from llama.cpp sources ``src`` into
    ``build`` (see the module docstring for why each flag)."""
    cmd = ["cmake", "-S", str(src), "-B", str(build)]
    if generator:
        cmd += ["-G", generator]
    return cmd + [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=ON",  # tools/server lives under tools/
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_MTMD=OFF",
        "-DGGML_NATIVE=ON",
        "-DGGML_OPENMP=OFF",
        "-DGGML_CUDA=OFF",
        "-DGGML_METAL=OFF",
        "-DGGML_VULKAN=OFF",
        "-DGGML_BLAS=OFF",
        "-DCMAKE_C_FLAGS=-fno-dse -fno-tree-dse",
        "-DCMAKE_CXX_FLAGS=-fno-dse -fno-tree-dse",
    ]


def fetch_sdist(version: str, progress: Callable[[str], None] = say) -> Path:
    """The sdist ``llama_cpp_python-<version>.tar.gz``, downloaded once by pip into ``<cache>/sdist``.

    Raises:
        RuntimeError: pip could not fetch it (its output's tail in the message).
    """
    dest = cache_base() / "sdist"
    hit = sorted(dest.glob(f"llama_cpp_python-{version}.tar.gz"))
    if hit:
        return hit[0]
    dest.mkdir(parents=True, exist_ok=True)
    progress(f"fetching the llama-cpp-python=={version} sdist into {dest} (pip download, once)")
    # --no-binary for this package only: with :all: pip also builds the sdist's build requirements
    # (scikit-build-core, ...) from source, nested, to prepare its metadata (many minutes)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                        f"llama-cpp-python=={version}", "-d", str(dest)],
                       capture_output=True, text=True)
    hit = sorted(dest.glob(f"llama_cpp_python-{version}.tar.gz"))
    if r.returncode or not hit:
        raise RuntimeError(f"pip download llama-cpp-python=={version} failed: {(r.stdout + r.stderr)[-1500:]}")
    return hit[0]


def _run_logged(cmd: Sequence[str], log, progress: Callable[[str], None], what: str) -> None:
    """Run ``cmd`` with its output into the open file ``log``, a progress line every
    PROGRESS_EVERY_S seconds (ninja's last ``[done/total]``). Raises RuntimeError on a non-zero exit."""
    t0 = time.monotonic()
    p = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT)
    while True:
        try:
            p.wait(timeout=PROGRESS_EVERY_S)
            break
        except subprocess.TimeoutExpired:
            log.flush()
            steps = re.findall(r"^\s*\[\s*(\d+/\d+|\d+%)\]", Path(log.name).read_text(errors="replace"), re.M)
            progress(f"  {what}: {'[' + steps[-1] + ']' if steps else 'running'} after {time.monotonic() - t0:.0f} s")
    if p.returncode:
        log.flush()
        tail = Path(log.name).read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{what} failed (exit {p.returncode}); the log: {log.name}\n{tail}")


def llama_server_binary(progress: Callable[[str], None] = say, build: bool = True) -> Path | None:
    """The cached ``llama-server`` for the pinned sdist on this CPU, built first when missing
    and ``build`` (minutes: see the module docstring); None when missing and not ``build``.

    Raises:
        RuntimeError: the sdist could not be fetched, or CMake failed (the log's tail in the message).
    """
    version = pinned_version()
    out = server_path(version)
    if out.is_file() and os.access(out, os.X_OK):
        return out
    if not build:
        return None
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama-server needs {tool!r} on PATH")
    sdist = fetch_sdist(version, progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.parent / "build.log"
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llama-server-build.", dir=out.parent) as tmp, \
            open(log_path, "w", encoding="utf-8") as log:
        progress(f"building llama-server from {sdist.name}'s vendored llama.cpp into {out.parent} "
                 f"(once per machine; minutes on 2 cores; log: {log_path})")
        with tarfile.open(sdist) as tf:
            members = [m for m in tf.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
            tf.extractall(tmp, members=members, filter="data")
        src = next(Path(tmp).glob("*/vendor/llama.cpp"))
        if not (src / "tools" / "server").is_dir():
            raise RuntimeError(f"{sdist.name} vendors no llama.cpp tools/server")
        build_dir = Path(tmp) / "build"
        gen = "Ninja" if shutil.which("ninja") else None
        _run_logged(cmake_configure_args(src, build_dir, gen), log, progress, "cmake configure")
        jobs = str(os.cpu_count() or 2)
        _run_logged(["cmake", "--build", str(build_dir), "--config", "Release", "--target", "llama-server",
                     "-j", jobs], log, progress, "llama-server build")
        built = next((p for p in build_dir.rglob("llama-server") if p.is_file() and os.access(p, os.X_OK)), None)
        if built is None:
            raise RuntimeError(f"the build ended without a llama-server binary; the log: {log_path}")
        tmp_out = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.copy2(built, tmp_out)
        os.replace(tmp_out, out)
    progress(f"  llama-server built in {time.monotonic() - t0:.0f} s: {out}")
    return out


# ---- running it --------------------------------------------------------------------------------


def server_help(binary: Path) -> str:
    """``llama-server --help``'s text (stdout and stderr)."""
    r = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    return r.stdout + r.stderr


def spec_types(help_text: str) -> list[str]:
    """The ``--spec-type`` values a ``llama-server --help`` lists (e.g. ``ngram-simple``,
    ``ngram-mod``, ``draft-simple``); [] when this llama.cpp has no ``--spec-type``."""
    m = re.search(r"--spec-type\s+\[?([a-z0-9,|\-\[\]]+)", help_text)
    if not m:
        return []
    return [t for t in re.split(r"[,|\[\]]+", m.group(1)) if t and t != "none"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(binary: Path, model: Path, port: int, parallel: int, ctx_per_slot: int, threads: int,
                   spec_type: str | None = None, draft_model: Path | None = None,
                   extra: Sequence[str] = ()) -> list[str]:
    """The ``llama-server`` command line for one configuration.

    Args:
        binary: the ``llama-server`` executable.
        model: the target GGUF.
        port: TCP port on 127.0.0.1.
        parallel: slots (``-np``): requests decoded at once in one batched decode (continuous batching).
        ctx_per_slot: tokens of context each slot holds; ``-c`` is ``parallel * ctx_per_slot``
            (without a unified KV cache each slot gets ``-c / -np``).
        threads: CPU threads for generation and batches (``-t``, ``-tb``; the draft's too).
        spec_type: llama.cpp's own speculation (``--spec-type``, e.g. ``ngram-simple``), or None.
        draft_model: a draft GGUF (``-md``) for draft-model speculation, or None; its pools and the
            target's wait without polling (``--poll 0`` and the draft's, batch and not).
        extra: more arguments, appended as given.

    Raises:
        ValueError: ``parallel`` or ``ctx_per_slot`` or ``threads`` below 1.
    """
    if parallel < 1 or ctx_per_slot < 1 or threads < 1:
        raise ValueError(f"parallel={parallel}, ctx_per_slot={ctx_per_slot}, threads={threads}: each must be >= 1")
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(parallel), "-c", str(parallel * ctx_per_slot), "--no-kv-unified",
           "-t", str(threads), "-tb", str(threads), "--no-webui"]
    if spec_type:
        cmd += ["--spec-type", spec_type]
    if draft_model is not None:
        # no thread polling in either pool: with both pools polling on a 2-core host each one's spinning
        # threads took the cores from the other, and a 64-token request ran 6x slower (bench/RESULTS.md,
        # "Twenty-second session")
        cmd += ["-md", str(draft_model), "-td", str(threads), "-tbd", str(threads),
                "--poll", "0", "--poll-batch", "0", "--poll-draft", "0", "--poll-batch-draft", "0"]
    return cmd + list(extra)


def wait_healthy(base: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    """Poll ``<base>/health`` until it answers 200.

    Raises:
        RuntimeError: ``proc`` exited first, or ``timeout_s`` seconds passed.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before /health answered")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{base}/health did not answer 200 within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM ``proc`` (started by us), SIGKILL after ``grace_s`` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@contextlib.contextmanager
def running(cmd: Sequence[str], port: int, log_path: Path, env: dict | None = None,
            timeout_s: float = 300.0) -> Iterator[str]:
    """Start ``cmd`` (a server listening on 127.0.0.1:``port``), wait for /health, yield its
    ``http://127.0.0.1:<port>`` and stop it after. Its output goes to ``log_path``.

    Raises:
        RuntimeError: it did not become healthy (the log's tail in the message).
    """
    with running_process(cmd, port, log_path, env, timeout_s) as (base, _proc):
        yield base


@contextlib.contextmanager
def running_process(cmd: Sequence[str], port: int, log_path: Path, env: dict | None = None,
                    timeout_s: float = 300.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """:func:`running`, yielding ``(base url, the server's Popen)`` (its pid for
    :func:`process_cpu_seconds`)."""
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_healthy(base, proc, timeout_s)
            except RuntimeError as e:
                log.flush()
                raise RuntimeError(f"{e}; {Path(cmd[0]).name} log tail:\n"
                                   f"{log_path.read_text(errors='replace')[-2000:]}") from None
            yield base, proc
        finally:
            stop(proc)


# ---- what a server process spends -----------------------------------------------------------------


def parse_stat(text: str) -> dict[str, int]:
    """The fields of one ``/proc/<pid>/stat`` line the CPU accounting needs: ``pid``, ``ppid``,
    ``utime``, ``stime`` (this process, all its threads), ``cutime``, ``cstime`` (its children
    that have exited and were waited for), the times in clock ticks (``os.sysconf("SC_CLK_TCK")``).
    The command name (field 2) may hold spaces and parentheses: the fields are read after its
    last ``)`` (proc(5): field 14 utime, 15 stime, 16 cutime, 17 cstime).

    Raises:
        ValueError: not a stat line.
    """
    head, sep, rest = text.rpartition(")")
    f = rest.split()
    if not sep or "(" not in head or len(f) < 15:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:120]!r}")
    return {"pid": int(head.split("(", 1)[0]), "ppid": int(f[1]), "utime": int(f[11]), "stime": int(f[12]),
            "cutime": int(f[13]), "cstime": int(f[14])}


def tree_cpu_ticks(stats: dict[int, dict[str, int]], pid: int) -> int:
    """CPU ticks of process ``pid`` and every live descendant in ``stats`` ({pid: :func:`parse_stat`}),
    user + system, plus the exited children each of them waited for (``cutime + cstime``)."""
    kids: dict[int, list[int]] = {}
    for p, s in stats.items():
        kids.setdefault(s["ppid"], []).append(p)
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen or p not in stats:
            continue
        seen.add(p)
        s = stats[p]
        total += s["utime"] + s["stime"] + s["cutime"] + s["cstime"]
        todo += kids.get(p, [])
    return total


def process_cpu_seconds(pid: int, proc: Path = Path("/proc")) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far, its live descendants and
    waited-for children included (:func:`tree_cpu_ticks` over ``/proc``). Unlike wall-clock
    throughput, the difference over a load is what the server itself spent, whatever else runs
    on the host (a shared host's other jobs do not add to it; at one engine thread no worker
    spins in a barrier either).

    Raises:
        ProcessLookupError: no process ``pid``.
    """
    stats = {}
    for d in proc.iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, ValueError):
                s = parse_stat((d / "stat").read_text())
                stats[s["pid"]] = s
    if pid not in stats:
        raise ProcessLookupError(f"no process {pid} under {proc}")
    return tree_cpu_ticks(stats, pid) / os.sysconf("SC_CLK_TCK")


def thread_cpu_ticks(pid: int, proc: Path = Path("/proc")) -> dict[int, int]:
    """``{thread id: user + system ticks}`` of process ``pid``'s live threads (``/proc/<pid>/task``);
    {} when it is gone. A thread that ended before the reading is not in it (its ticks stay in
    the process's total)."""
    out = {}
    with contextlib.suppress(OSError):
        for d in (proc / str(pid) / "task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                s = parse_stat((d / "stat").read_text())
                out[s["pid"]] = s["utime"] + s["stime"]
    return out


def busiest_thread_seconds(before: dict[int, int], after: dict[int, int]) -> float | None:
    """CPU seconds of the thread that used the most between two :func:`thread_cpu_ticks` readings
    (a thread started in between counts from 0): the engine's thread in a server whose decoding
    runs on one thread (draftd's serving thread, llama-server's main loop at ``-t 1``); None
    without threads."""
    d = [t - before.get(k, 0) for k, t in after.items()]
    return max(d) / os.sysconf("SC_CLK_TCK") if d else None


def prometheus_values(text: str) -> dict[str, float]:
    """``{name: value}`` of the unlabelled samples in a Prometheus text exposition (llama-server's
    ``/metrics``: ``llamacpp:n_decode_total`` etc.); comments and labelled samples are skipped."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "{" in line:
            continue
        parts = line.split()
        if len(parts) >= 2:
            with contextlib.suppress(ValueError):
                out[parts[0]] = float(parts[1])
    return out


def main() -> None:
    b = llama_server_binary()
    print(b)
    print("spec types:", ", ".join(spec_types(server_help(b))) or "none (no --spec-type in this llama.cpp)")


if __name__ == "__main__":
    main()
