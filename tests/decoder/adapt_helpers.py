"""A tiny pair whose agreement LoRA adapters control exactly, and a real registry on Redis.

- ``shallow_target``: a 3-layer tiny Llama whose layers 1.. add exact zeros to the residual
  (o_proj and down_proj zeroed), so it computes what its first layer computes, at 3 layers' cost.
- ``exact_draft``: a 1-layer Llama holding the target's embeddings, layer 0, norm and head: the
  same logits as the target (α = 1 greedy) at under half its cost.
- ``perturb``: adds a rank-r perturbation U·V to some linear layers of a draft (α drops).
- ``save_lora``: writes a real peft adapter (save_pretrained layout) with given B, A per module;
  with B = -U / scaling, A = V it cancels the perturbation (the "adapted" draft).
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
import uuid
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from store.client import connect
from store.config import StoreConfig
from store.registry import AdapterMeta, AdapterRegistry
from tiny import tiny_llama

SHARED_URL = "redis://127.0.0.1:6379/0"
MODULES = ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj")


def shallow_target(seed: int = 1234, layers: int = 3) -> LlamaForCausalLM:
    m = tiny_llama(seed, layers=layers, hidden=48, head_scale=20.0)
    with torch.no_grad():
        for layer in m.model.layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return m


def exact_draft(target: LlamaForCausalLM) -> LlamaForCausalLM:
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = 1
    d = LlamaForCausalLM(cfg).eval()
    sd = {k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    d.load_state_dict(sd)
    d.requires_grad_(False)
    return d


def perturb(draft, scale: float = 3.0, rank: int = 2, seed: int = 0, modules=MODULES) -> dict[str, tuple]:
    """W += U @ V on ``modules``; returns name -> (U (out, r), V (r, in))."""
    g = torch.Generator().manual_seed(seed)
    mods = dict(draft.named_modules())
    out = {}
    with torch.no_grad():
        for name in modules:
            w = mods[name].weight  # (out, in)
            u = torch.randn(w.shape[0], rank, generator=g) * scale
            v = torch.randn(rank, w.shape[1], generator=g) / w.shape[1] ** 0.5
            w.add_(u @ v)
            out[name] = (u, v)
    return out


def save_lora(draft, directory: Path, weights: dict[str, tuple], r: int, lora_alpha: int | None = None) -> Path:
    """A peft adapter for ``draft`` with lora_B, lora_A = weights[name] (shapes (out, r), (r, in))."""
    lora_alpha = lora_alpha or r
    model = get_peft_model(copy.deepcopy(draft), LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(weights),
                                                             task_type="CAUSAL_LM"), adapter_name="x")
    mods = dict(model.base_model.model.named_modules())
    with torch.no_grad():
        for name, (b, a) in weights.items():
            mods[name].lora_B["x"].weight.copy_(b)
            mods[name].lora_A["x"].weight.copy_(a)
    directory = Path(directory)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, selected_adapters=["x"])
        src = Path(tmp) / "x" if (Path(tmp) / "x").is_dir() else Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        for n in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copy(src / n, directory / n)
    return directory


def fixing_lora(draft, noise: dict[str, tuple], directory: Path) -> Path:
    """The adapter that cancels ``perturb``'s noise: B·A·scaling = -U·V (scaling = 1)."""
    r = next(iter(noise.values()))[0].shape[1]
    return save_lora(draft, directory, {n: (-u, v) for n, (u, v) in noise.items()}, r=r, lora_alpha=r)


def random_lora(draft, directory: Path, scale: float, seed: int, r: int = 2, modules=MODULES) -> Path:
    g = torch.Generator().manual_seed(seed)
    mods = dict(draft.named_modules())
    w = {}
    for n in modules:
        out_f, in_f = mods[n].weight.shape
        w[n] = (torch.randn(out_f, r, generator=g) * scale, torch.randn(r, in_f, generator=g) / in_f ** 0.5)
    return save_lora(draft, directory, w, r=r, lora_alpha=r)


class RedisRegistry:
    """A real AdapterRegistry on the shared Redis under a unique prefix; ``close()`` deletes it."""

    def __init__(self, artifact_dir: Path, url: str = SHARED_URL):
        self.prefix = f"test:decoder:{uuid.uuid4().hex[:12]}:"
        self.config = StoreConfig(key_prefix=self.prefix)
        self.client = connect(url)
        self.registry = AdapterRegistry(self.client, artifact_dir, self.config)

    def register(self, src: Path, scope: str = "") -> int:
        return self.registry.register(src, AdapterMeta(parent=0, scope=scope))

    def close(self) -> None:
        for k in self.client.scan_iter(match=f"{self.prefix}*".encode(), count=1000):
            self.client.delete(k)
        self.client.close()


def adapter_config(directory: Path) -> dict:
    return json.loads((Path(directory) / "adapter_config.json").read_text())
