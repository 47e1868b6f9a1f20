"""scripts/install's CMake project include (scripts/llama-cpp-lib-only.cmake) on a stand-in for
llama-cpp-python's build: its top level forces LLAMA_BUILD_COMMON ON before adding llama.cpp, and
llama.cpp builds common only when the variable is on. Configure only (LANGUAGES NONE): no compiler."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "scripts" / "llama-cpp-lib-only.cmake"

TOP = """cmake_minimum_required(VERSION 3.21)
project(llama_cpp LANGUAGES NONE)
option(LLAVA_BUILD "mtmd" ON)
set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)
add_subdirectory(vendor/llama.cpp)
"""
LLAMA = """cmake_minimum_required(VERSION 3.14)
project("llama.cpp" LANGUAGES NONE)
option(LLAMA_BUILD_COMMON "llama: build common utils library" ON)
add_subdirectory(sub)
if (LLAMA_BUILD_COMMON)
    message(STATUS "draftd-check common=ON")
else()
    message(STATUS "draftd-check common=OFF")
endif()
"""
SUB = 'message(STATUS "draftd-check sub=${LLAMA_BUILD_COMMON}")\n'


@pytest.fixture
def project(tmp_path):
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    (tmp_path / "vendor" / "llama.cpp" / "sub").mkdir(parents=True)
    (tmp_path / "CMakeLists.txt").write_text(TOP)
    (tmp_path / "vendor" / "llama.cpp" / "CMakeLists.txt").write_text(LLAMA)
    (tmp_path / "vendor" / "llama.cpp" / "sub" / "CMakeLists.txt").write_text(SUB)
    return tmp_path


def _configure(src: Path, *args: str) -> list[str]:
    out = subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return re.findall(r"draftd-check (\w+=\w+)", out.stdout)


def test_the_include_turns_llama_cpps_common_library_off_without_mtmd(project):
    # without the include, the forced cache entry wins: common is built
    assert _configure(project, "-DLLAVA_BUILD=OFF") == ["sub=ON", "common=ON"]
    # with it (as scripts/install passes it), llama.cpp's directory and its subdirectories see OFF
    assert _configure(project, "-DLLAVA_BUILD=OFF", f"-DCMAKE_PROJECT_INCLUDE={HOOK}") == ["sub=OFF", "common=OFF"]


def test_the_include_leaves_common_on_where_mtmd_is_built(project):
    assert _configure(project, "-DLLAVA_BUILD=ON", f"-DCMAKE_PROJECT_INCLUDE={HOOK}") == ["sub=ON", "common=ON"]


def test_scripts_install_passes_the_include():
    text = (ROOT / "scripts" / "install").read_text()
    assert "-DCMAKE_PROJECT_INCLUDE='$PWD/scripts/llama-cpp-lib-only.cmake'" in text
    assert HOOK.is_file()


def test_the_dependency_install_passes_each_requirement_whole(tmp_path):
    # the install beside the build hands pip pyproject.toml's requirements; one with an environment
    # marker holds blanks ("uvloop>=0.19; sys_platform != 'win32'"), and split into words pip
    # refused it ("Invalid requirement: '!='": a fresh clone's install failed at 5602b44)
    import sys
    import tomllib

    from packaging.requirements import Requirement

    text = (ROOT / "scripts" / "install").read_text()
    start = text.index('( .venv/bin/python -m pip --disable-pip-version-check -q install "torch==')
    block = text[start:text.index(') >"$DEPLOG"', start) + 1]
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    stub = tmp_path / ".venv" / "bin" / "python"  # `-m pip ... install ARGS` records ARGS, one a line
    stub.write_text(f"""#!/usr/bin/env bash
if [ "$1" = -m ]; then shift 2; while [ "${{1#-}}" != "$1" ]; do shift; done; shift
  printf '%s\\n' "$@" >> "{tmp_path}/args"; printf -- '--\\n' >> "{tmp_path}/args"; exit 0; fi
exec "{sys.executable}" "$@"
""")
    stub.chmod(0o755)
    out = subprocess.run(["bash", "-c", f"set -euo pipefail\n{block}"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    torch, deps, _ = (tmp_path / "args").read_text().split("--\n")
    assert torch.splitlines() == ["torch==2.13.0"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    want = [d for d in project["dependencies"] + project["optional-dependencies"]["test"]
            if not d.startswith("llama-cpp-python")]
    assert deps.splitlines() == want
    assert any(";" in d for d in want)  # the case that broke: a marker with blanks, passed whole
    for d in deps.splitlines():
        Requirement(d)
