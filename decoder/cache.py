"""Where draftd keeps what it converts (GGUF files, dequantised copies, split adapters): one root
for :mod:`decoder.models` and :mod:`decoder.gguf_export`, which each need it and must not import
each other for it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Directory for converted models: ``$DRAFTD_CACHE_DIR`` or ``~/.cache/draftd/models``."""
    root = os.environ.get("DRAFTD_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "draftd" / "models"
