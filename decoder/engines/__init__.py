"""Engines: what runs a model's forward passes for the decoder (one file per engine).

- :mod:`decoder.engines.base`: the :class:`Engine` / :class:`Sequence` protocols and the
  :class:`Capabilities` each engine declares (the decoder asks these, never the engine's class).
- :mod:`decoder.engines.torch_engine`: :class:`TorchEngine` (transformers).
- :mod:`decoder.engines.llamacpp`: :class:`LlamaCppEngine` (GGUF in llama.cpp); its C plumbing
  (bindings, the compute thread, the extra-buffer probe) in :mod:`decoder.engines.llamacpp_lib`.
- :mod:`decoder.engines.registry`: :func:`choose_engine` (``models.engine = auto | torch | llamacpp``).
"""
