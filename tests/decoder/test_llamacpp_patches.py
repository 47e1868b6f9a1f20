"""scripts/patches: the changes scripts/install applies to the pinned llama-cpp-python sdist.

The patches must apply to the pinned version (checked against the sdist where a cache holds it), and
on a CPU where the patched code is compiled (AMX), the installed llama.cpp must be the patched build.
"""

from __future__ import annotations

import os
import re
import subprocess
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


def _cpu_has_amx() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    return "amx_int8" in text.split()


def _switches(patch: Path) -> list[str]:
    """The environment switches a patch adds (its ``getenv("...")`` calls)."""
    return re.findall(r'getenv\("([A-Z0-9_]+)"\)', "\n".join(
        line for line in patch.read_text().splitlines() if line.startswith("+")))


def test_every_patch_has_a_switch_back_to_upstream():
    """Each patch can be turned off at run time, so a bench measures it against upstream in one build."""
    assert {p.name: bool(_switches(p)) for p in PATCHES} == {p.name: True for p in PATCHES}


@pytest.mark.skipif(not _cpu_has_amx(), reason="the patched code is compiled only where the CPU has AMX/AVX-512")
def test_the_installed_llama_cpp_is_the_patched_build():
    """Each patch's switch name is in the CPU backend only when the patched source was built (an
    unpatched wheel left in a cache would lack it)."""
    import llama_cpp

    libs = list((Path(llama_cpp.__file__).parent / "lib").glob("libggml-cpu.so*"))
    assert libs, "llama_cpp ships libggml-cpu"
    for lib in libs:
        data = lib.read_bytes()
        missing = [name for p in PATCHES for name in _switches(p) if name.encode() not in data]
        assert not missing, (lib, missing)
