"""The transformers engine: a torch causal LM's forwards on a ``DynamicCache``."""

from __future__ import annotations

import torch

from decoder.engines.base import Capabilities


class TorchSequence:
    """A request's ``DynamicCache`` on a :class:`TorchEngine`."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        from transformers import DynamicCache

        self.model, self.device = model, device
        self.cache = DynamicCache(config=model.config)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def forward(self, tokens: list[int], keep: int, hidden: bool = False):
        x = torch.tensor([tokens], device=self.device)
        if not hidden:
            return self.model(input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=keep).logits[0]
        out = self.model(input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=keep,
                         output_hidden_states=True)
        return out.logits[0], out.hidden_states[-1][0, -keep:]

    def truncate(self, length: int) -> None:
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5: crop(-n) removes n positions


class TorchEngine:
    """A transformers causal LM as an engine (the decoder's default, and every non-GGUF model).

    model: a ``PreTrainedModel`` with ``logits_to_keep`` (Llama/Gemma/Qwen families)."""

    name = "torch"
    capabilities = Capabilities(hidden_states=True, lora=False, batch=False, torch_module=True, own_threads=False)

    def __init__(self, model: torch.nn.Module, eos_ids=()):
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.hidden_size = int(getattr(model.config, "hidden_size", 0))
        self.context_length = getattr(model.config, "max_position_embeddings", None)
        self.eos_ids = frozenset(eos_ids)

    def start(self) -> TorchSequence:
        return TorchSequence(self.model, self.device)

    def describe(self) -> dict:
        p = next(self.model.parameters())
        return {"engine": self.name, "model": getattr(self.model.config, "_name_or_path", "") or
                type(self.model).__name__, "device": str(p.device), "dtype": str(p.dtype).replace("torch.", ""),
                "threads": torch.get_num_threads()}

