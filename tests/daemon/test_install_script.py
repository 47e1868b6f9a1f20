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
