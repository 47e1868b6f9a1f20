"""scripts/patches: the changes scripts/install applies to the pinned llama-cpp-python sdist.

The patches must apply to the pinned version (checked against the sdist where a cache holds it), on
a CPU where a patch's code is compiled the installed llama.cpp must be the patched build, and the
x86 tiled matmul must give the same bits as upstream's kernels (its switch off) at every row count.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHES = sorted((ROOT / "scripts" / "patches").glob("*.patch"))


def _pin() -> str:
    m = re.search(r"llama-cpp-python==([0-9.]+)", (ROOT / "pyproject.toml").read_text())
    assert m, "pyproject.toml pins llama-cpp-python"
    return m.group(1)


def _cached_sdist() -> Path | None:
    root = Path(os.environ.get("DRAFTD_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or
                                                            Path.home() / ".cache") / "draftd")
    p = root / "sdist" / f"llama_cpp_python-{_pin()}.tar.gz"
    return p if p.is_file() else None


def _patched_files(patch: Path) -> list[str]:
    return [line[6:].strip() for line in patch.read_text().splitlines() if line.startswith("+++ b/")]


def test_every_patch_names_files_under_the_vendored_llama_cpp():
    assert PATCHES, "scripts/patches holds the patches scripts/install applies"
    for p in PATCHES:
        files = _patched_files(p)
        assert files and all(f.startswith("vendor/llama.cpp/") for f in files), (p.name, files)


def test_the_patches_apply_to_the_pinned_sdist(tmp_path):
    sdist = _cached_sdist()
    if sdist is None:
        pytest.skip("no llama-cpp-python sdist in the cache (scripts/install fetches it on a fresh build)")
    top = f"llama_cpp_python-{_pin()}"
    with tarfile.open(sdist) as tar:
        for p in PATCHES:
            for f in _patched_files(p):
                tar.extract(f"{top}/{f}", tmp_path, filter="data")
    for p in PATCHES:
        r = subprocess.run(["git", "apply", "--check", "-p1", str(p)], cwd=tmp_path / top,
                           capture_output=True, text=True)
        assert r.returncode == 0, (p.name, r.stderr)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k.strip() == "flags":
            return set(v.split())
    return set()


# where each patch's code is compiled (its #if): the CPU flags a native build turns on
COMPILED_WHERE = {
    "ggml-amx-few-rows.patch": {"amx_int8"},
    "ggml-fa-bf16v-blocked.patch": {"avx2", "fma", "f16c"},  # AVX-512 CPUs have all three
    "ggml-x86-tiled-q4_1-q8_0.patch": {"avx2", "fma"},
}


def _switches(patch: Path) -> list[str]:
    """The environment switches a patch adds (its ``getenv("...")`` calls)."""
    return re.findall(r'getenv\("([A-Z0-9_]+)"\)', "\n".join(
        line for line in patch.read_text().splitlines() if line.startswith("+")))


def test_every_patch_has_a_switch_back_to_upstream():
    """Each patch can be turned off at run time, so a bench measures it against upstream in one build."""
    assert {p.name: bool(_switches(p)) for p in PATCHES} == {p.name: True for p in PATCHES}


def test_every_patch_says_where_it_is_compiled():
    assert sorted(COMPILED_WHERE) == sorted(p.name for p in PATCHES)


def _compiled_here() -> list[Path]:
    flags = _cpu_flags()
    return [p for p in PATCHES if COMPILED_WHERE.get(p.name, {"?"}) <= flags]


@pytest.mark.skipif(not _compiled_here(), reason="no patch's code is compiled on this CPU")
def test_the_installed_llama_cpp_is_the_patched_build():
    """Each patch compiled on this CPU has its switch name in the CPU backend, which only the
    patched source puts there (an unpatched wheel left in a cache would lack it)."""
    import llama_cpp

    libs = list((Path(llama_cpp.__file__).parent / "lib").glob("libggml-cpu.so*"))
    assert libs, "llama_cpp ships libggml-cpu"
    for lib in libs:
        data = lib.read_bytes()
        missing = [name for p in _compiled_here() for name in _switches(p) if name.encode() not in data]
        assert not missing, (lib, missing)


_LOGITS = r"""
import hashlib, random, sys
import numpy as np
from decoder.engines.llamacpp import LlamaCppEngine
eng = LlamaCppEngine(sys.argv[1], n_ctx=1024, threads=int(sys.argv[2]))
rng = random.Random(7)
seq = eng.start()
h = hashlib.sha256()
h.update(np.ascontiguousarray(seq.forward([rng.randrange(100, 40000) for _ in range(151)], 151), dtype=np.float32).tobytes())
for n in (1, 1, 2, 3, 4, 5, 9):
    h.update(np.ascontiguousarray(seq.forward([rng.randrange(100, 40000) for _ in range(n)], n), dtype=np.float32).tobytes())
print(h.hexdigest())
"""


def _logits_digest(gguf: Path, threads: int, **switches: str) -> str:
    env = {**os.environ, **switches, "DRAFTD_LLAMA_LOG": "0"}
    r = subprocess.run([sys.executable, "-c", _LOGITS, str(gguf), str(threads)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()[-1]


@pytest.mark.skipif(not {"avx2", "fma"} <= _cpu_flags(), reason="the tiled matmul is compiled where the CPU has AVX2 and FMA")
@pytest.mark.parametrize("threads", [1, 2])
def test_the_tiled_matmul_gives_upstreams_bits(threads):
    """The packaged Q4_1 target (whose token embedding, the output head, is Q8_0): a prompt of 151
    rows (an odd count: the last tile of activation rows is a partial one), two plain steps and
    verifications of 2-9 rows give the same logits, bit for bit, with the tiled kernels (from 5
    rows on the pre-unpacked ones) as with the per-pair tiles at every row count (GGML_X86_PRE=0)
    and as with upstream's kernels (GGML_X86_TILED=0), at one and two threads."""
    from decoder.models.packaged import packaged_gguf

    try:
        gguf = packaged_gguf("smollm2-135m")
    except Exception as e:  # noqa: BLE001 - the packaged model is an install-time dependency
        pytest.skip(f"packaged model unavailable: {e}")
    upstream = _logits_digest(gguf, threads, GGML_X86_TILED="0")
    assert _logits_digest(gguf, threads, GGML_X86_TILED="1", GGML_X86_PRE="0") == upstream
    assert _logits_digest(gguf, threads, GGML_X86_TILED="1", GGML_X86_PRE="1") == upstream
