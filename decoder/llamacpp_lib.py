"""llama-cpp-python's low-level bindings, loaded and initialised once, and the names draftd
writes into its GGUF files: the plumbing that both the llama.cpp engine
(:mod:`decoder.engine`) and GGUF conversion (:mod:`decoder.gguf_export`) need, in a module that
imports neither (they used to import each other)."""

from __future__ import annotations

import importlib.util
import os
import threading

# GGUF metadata of draftd's Q4_1 split (decoder.gguf_export.q4_1_split_gguf): the key holding its
# offset adapter's file name, and the key of the split's identity
SPLIT_KEY = "draftd.q4_1_split.offset_lora"
SPLIT_ID_KEY = "draftd.q4_1_split.id"


class EngineError(RuntimeError):
    """An engine cannot be built or run as asked; the message says what to change."""


def llamacpp_available() -> bool:
    """True when llama-cpp-python can be imported (it is a dependency; a broken build may lack it)."""
    return importlib.util.find_spec("llama_cpp") is not None


_init_lock = threading.Lock()
_initialised = False
_log_cb = None  # the ctypes log callback must outlive every call into llama.cpp


def bindings():
    """llama-cpp-python's low-level bindings, initialised once, with llama.cpp's logging off
    (``DRAFTD_LLAMA_LOG=1`` keeps it). Load models after :func:`decoder.engine.llama_extra_buffers`."""
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


