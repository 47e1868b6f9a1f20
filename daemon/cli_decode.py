"""`daemonctl generate` and `daemonctl bench`: the decoder from the command line."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from daemon.logging import configure, console
from decoder.engines.base import supports

err = console(stderr=True)


def _load(target: str, draft: str, device: str, int8: bool, draft_vocab: int, engine: str = "auto",
          threads: int | None = None, target_format: str = "packaged", format_max_seconds: float | None = None):
    from decoder.engines.registry import choose_engine
    from decoder.models.loading import load_pair

    configure("auto", "warning", stream=sys.stderr)  # stdout carries only the text / the JSON

    with err.status(f"loading {target} (+ draft {draft}); the first run converts the GGUF (~30 s)"):
        pair = load_pair(target, draft, device=device, int8_draft=int8, progress=lambda s: err.log(s))
        dv = None
        if draft_vocab:
            from decoder.vocab import frequent_token_ids

            dv = frequent_token_ids(pair.tokenizer, draft_vocab)
        choice = choose_engine(engine, target, device, draft, threads, target_format=target_format,
                               progress=lambda s: err.log(s), draft_vocab=dv, format_max_seconds=format_max_seconds)
    err.log(f"engine: {choice.name} ({choice.reason})")
    return pair, dv, choice


def _decoder(pair, dv, draft_precision: str = "auto", choice=None):
    from decoder.speculative import DecoderConfig, SpeculativeDecoder

    return SpeculativeDecoder(pair.target, pair.draft, pair.tokenizer,
                              DecoderConfig(draft_vocab=dv, draft_precision=draft_precision),
                              engine=choice.target if choice else None, draft_engine=choice.draft if choice else None)


def _check_precision(value: str) -> str:
    from decoder.draft_weights import PRECISIONS

    if value not in PRECISIONS:
        raise ValueError(f"--draft-precision {value!r}: use one of {', '.join(PRECISIONS)}")
    return value


DraftPrecisionOpt = Annotated[str, typer.Option(
    help="dtype of the draft's proposals: auto (bf16 where measured 10 % faster), fp32, bf16; lossless either way")]


def apply_adapter(pair, choice, path: Path) -> str:
    """Put a trained peft LoRA adapter (a registry artifact: adapter_config.json +
    adapter_model.safetensors) on the draft that proposes: merged into the torch draft's weights,
    or converted to a GGUF LoRA and set on the llama.cpp draft's context. Returns what it did.

    Raises:
        ValueError: the adapter does not fit the draft (names the field or tensor).
    """
    from decoder.adapters import AdapterError, check_compatible

    try:
        check_compatible(pair.draft, path)
    except AdapterError as e:
        raise ValueError(f"--adapter {str(path)!r}: {e}") from e
    if choice is not None and supports(choice.draft, "lora"):
        from decoder.models.gguf_export import lora_gguf_cached
        from decoder.models.packaged import cache_root

        gguf = lora_gguf_cached(path, cache_root() / "gguf" / "lora", choice.draft.path)
        choice.draft.load_lora("bench", gguf)
        choice.draft.set_lora("bench")
        return f"GGUF LoRA {gguf.name} set on the llama.cpp draft"
    from peft import PeftModel

    pair.draft = PeftModel.from_pretrained(pair.draft, str(path)).merge_and_unload()
    return "merged into the torch draft"


def _check_engine(engine: str) -> str:
    from decoder.engines.registry import ENGINES

    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")
    return engine


def generate_format(option: str | None) -> tuple[str, float | None, str]:
    """The weight format ``generate`` decodes a built-in target in: ``(models.format value, the
    auto measurement's budget in s or None, where the value came from)``. ``--format`` first;
    else ``models.format`` where the environment (``DRAFTD_MODELS__FORMAT``) or the config file
    (``DRAFTD_CONFIG``) sets it; ``models.format_max_seconds`` either way, as serve resolves it; else
    ``packaged``: serve's own default, ``auto``, may measure for minutes before one prompt
    (``--format auto`` asks for it, and takes serve's cached choice at no cost).

    Raises:
        daemon.settings.ConfigError: the settings do not load (a ValueError; names the setting).
    """
    from daemon.settings import load_settings

    m = load_settings().models
    if option is not None:  # the measurement's budget as serve's, --format auto included
        return option, m.format_max_seconds, "--format"
    if "format" in m.model_fields_set:
        return m.format, m.format_max_seconds, "models.format (DRAFTD_MODELS__FORMAT or the config file)"
    return "packaged", None, "the default (models.format unset; serve's auto measures: --format auto)"


def _check_proposers(text: str) -> tuple[str, ...]:
    """``"ngram,draft"`` -> ``("ngram", "draft")``.

    Raises:
        ValueError: an unknown, empty or repeated name (names it).
    """
    from decoder.proposers.registry import PROPOSERS

    names = tuple(x.strip() for x in text.split(","))
    bad = [x for x in names if x not in PROPOSERS]
    if bad or len(set(names)) != len(names):
        raise ValueError(f"--proposers/--proposer {text!r}: use one or more of {', '.join(PROPOSERS)}, each once")
    return names


def check_generate_args(prompt: str, gamma: int, max_new_tokens: int, temperature: float, stop, draft_vocab: int,
                        seed: int | None = None) -> None:
    """Refuse bad `generate` options before the models load, naming the option and the fix.

    Raises:
        ValueError: the first bad option.
    """
    from daemon.serve import MAX_GAMMA

    if not prompt:
        raise ValueError("--prompt is empty: give at least one character of prompt text")
    if gamma < 0:
        raise ValueError(f"--gamma {gamma}: must be >= 0 (0 = plain decoding, like --no-spec)")
    if gamma > MAX_GAMMA:
        raise ValueError(f"--gamma {gamma}: at most {MAX_GAMMA}, as a served request's gamma (each step verifies "
                         f"γ + 1 rows)")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
    if not math.isfinite(temperature):
        raise ValueError(f"--temperature {temperature}: must be a finite number >= 0 (0 = greedy)")
    if any(s == "" for s in stop or ()):
        raise ValueError("--stop '': an empty stop string matches at once and would end generation after one "
                         "token; drop it or give a non-empty string")
    if draft_vocab < 0:
        raise ValueError(f"--draft-vocab {draft_vocab}: must be >= 0 (0 = off)")
    if seed is not None:
        from daemon.serve import seed_problem  # the API's range: a served request's seed reproduces here

        if (why := seed_problem(seed)) is not None:
            raise ValueError(f"--seed {seed}: {why}")


def check_device(device: str) -> str:
    """``--device`` checked before the models load: a torch device this process can reach (a CPU-only
    torch asserted "Torch not compiled with CUDA enabled" after the load began). Returns ``device``.

    Raises:
        ValueError: not a torch device, a CUDA device with none visible or an index past them, an MPS
            device without MPS, or another kind (names the device and the fix).
    """
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"--device {device!r} is not a torch device ({e}); use cpu, cuda or cuda:N") from None
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"--device {device!r}: {why} (torch {torch.__version__}); use --device cpu, or a CUDA "
                             f"build of torch on a machine with a GPU")
        if d.index is not None and d.index >= n:
            raise ValueError(f"--device {device!r}: {n} CUDA device(s) visible, cuda:0 to cuda:{n - 1}; use one of them")
    elif d.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"--device {device!r}: MPS is not available here; use --device cpu")
    elif d.type != "cpu":
        raise ValueError(f"--device {device!r}: draftd decodes on cpu, cuda[:N] or mps; use one of them")
    return device


def check_context(target: str, max_new_tokens: int) -> None:
    """``--max-new-tokens`` against the target's trained context length where its GGUF header tells
    it before the models load (:func:`decoder.models.loading.trained_context_length`: a built-in
    target or a .gguf path): the prompt takes at least one token of the window. Other targets are
    checked after the load, against the prompt's length (``SpeculativeDecoder``).

    Raises:
        ValueError: max_new_tokens >= the context length (names both and the fix).
        decoder.models.packaged.ModelLoadError: a built-in target whose package is missing.
    """
    from decoder.models.loading import trained_context_length

    ctx = trained_context_length(target)
    if ctx is not None and max_new_tokens >= ctx:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: the target {target!r} has a context window of {ctx} "
                         f"tokens (prompt + new tokens), so at most {ctx - 1} new tokens fit; lower --max-new-tokens")


def parse_gammas(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``.

    Raises:
        ValueError: an item that is not an integer from 1 to ``daemon.serve.MAX_GAMMA`` (names it).
    """
    from daemon.serve import MAX_GAMMA

    out = []
    for item in text.split(","):
        try:
            g = int(item.strip())
        except ValueError:
            raise ValueError(f"--gammas {text!r}: {item.strip()!r} is not an integer; example: --gammas 1,2,4") from None
        if g < 1:
            raise ValueError(f"--gammas {text!r}: γ={g} must be >= 1 (plain decoding, γ = 0, is always included)")
        if g > MAX_GAMMA:
            raise ValueError(f"--gammas {text!r}: γ={g} is more than {MAX_GAMMA}, a served request's cap")
        out.append(g)
    return tuple(out)


EngineOpt = Annotated[str, typer.Option(
    help="auto (llama.cpp for a GGUF target on CPU when installed), torch (transformers), llamacpp")]
ProposerOpt = Annotated[str, typer.Option(help="draft (the draft model) or ngram (prompt lookup over the request and "
                                               "the workload's past requests)")]
TargetOpt = Annotated[str, typer.Option(help="target: built-in name (smollm2-135m, gemma3-270m; name@bf16: its GGUF "
                                              "requantised by llama.cpp), local path or cached hub id")]
DraftOpt = Annotated[str, typer.Option(help="draft: 'layers:0-3' (derived from the target), 'self', or a model reference")]


def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="prompt text")],
    gamma: Annotated[int, typer.Option(help="γ, draft tokens proposed per step")] = 4,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate at most")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: Annotated[int | None, typer.Option(help="per-request seed (sampling): a signed 64-bit integer, "
                                                 "-2^63 to 2^63 - 1, as the API's seed")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
    no_spec: Annotated[bool, typer.Option("--no-spec", help="plain decoding (γ = 0)")] = False,
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the chat template")] = False,
    check: Annotated[bool, typer.Option(help="greedy: also decode plainly and report token equivalence")] = True,
    target: TargetOpt = "smollm2-135m",
    draft: DraftOpt = "layers:0-3",
    device: str = "cpu",
    int8_draft: Annotated[bool, typer.Option(help="dynamic int8 quantisation of the draft (CPU)")] = False,
    draft_vocab: Annotated[int, typer.Option(help="FR-Spec: restrict the draft head to the N most frequent tokens (0 = off)")] = 0,
    draft_precision: DraftPrecisionOpt = "auto",
    engine: EngineOpt = "auto",
    proposer: ProposerOpt = "draft",
    json_out: Annotated[bool, typer.Option("--json", help="print only the JSON record")] = False,
    target_format: Annotated[str | None, typer.Option("--format", help="llama.cpp: the weight format a built-in target "
                                                      "is decoded in (packaged, auto, F16, Q8_0, ...; `daemonctl status` "
                                                      "shows what serve serves); default: models.format where "
                                                      "DRAFTD_MODELS__FORMAT or the config file sets it, else "
                                                      "packaged")] = None,
):
    """Generate text for one prompt and print it with its measurement record."""
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest
    from decoder.workloads import chat_format

    try:
        check_generate_args(prompt, gamma, max_new_tokens, temperature, stop, draft_vocab, seed)
        _check_precision(draft_precision)
        params = SamplingParams(temperature, top_p, top_k, seed)
        if len(_check_proposers(proposer)) != 1:
            raise ValueError(f"--proposer {proposer!r}: one request runs one proposer; give one of draft, ngram "
                             f"(bench --proposers takes a list)")
        _check_engine(engine)
        check_device(device)
        check_context(target, max_new_tokens)
        fmt, fmt_seconds, fmt_from = generate_format(target_format)
        err.log(f"format: {fmt} (from {fmt_from})")
        pair, dv, choice = _load(target, draft, device, int8_draft, draft_vocab, engine, target_format=fmt,
                                 format_max_seconds=fmt_seconds)
        dec = _decoder(pair, dv, draft_precision, choice)
    except (ValueError, RuntimeError) as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from e
    ids = chat_format(pair.tokenizer, prompt, raw=not chat)
    try:
        req = DecodeRequest(ids, params, max_new_tokens, gamma=0 if no_spec else gamma, stop=tuple(stop or ()),
                            proposer=proposer)
        from decoder.engines.registry import torch_threads_for

        with torch_threads_for(dec.engine):
            res = dec.generate(req)
    except ValueError as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from e
    if check and params.greedy and not no_spec:
        dec.check_against_plain(req, res)
    rec = {**res.record(), "draft_precision": dec.draft_precision, "engine_reason": choice.reason,
           "served_format": choice.served_format}
    if json_out:
        print(json.dumps({"text": res.text, **rec}))
        return
    print(res.text)
    err.print_json(json.dumps(rec))


def bench(
    quick: Annotated[bool, typer.Option(help="a subset (under a minute once the model is cached): 2 workloads, 1 prompt, γ ∈ {2, 4}, greedy, 32 tokens")] = False,
    workloads: Annotated[str, typer.Option(help="comma list: prose, code, math, humaneval, or JSONL paths")] = "prose,code,math",
    prompts: Annotated[int, typer.Option(help="prompts per workload")] = 2,
    gammas: Annotated[str, typer.Option(help="comma list of γ")] = "1,2,3,4,6,8",
    sampling: Annotated[str, typer.Option(help="comma list of greedy, t0.7-p0.9, t1.0")] = "greedy,t0.7-p0.9,t1.0",
    max_new_tokens: int = 64,
    hf: Annotated[bool, typer.Option(help="include transformers' plain and assisted generation")] = True,
    engine: EngineOpt = "auto",
    proposers: Annotated[str, typer.Option(help="comma list of proposers for the spec rows: draft, ngram")] = "draft",
    llamacpp_peer: Annotated[bool | None, typer.Option(
        help="add llama-cpp-python's own plain generation (same GGUF, same threads) as method llamacpp_plain; "
             "default: on when the engine is llamacpp")] = None,
    target: TargetOpt = "smollm2-135m",
    draft: DraftOpt = "layers:0-3",
    device: str = "cpu",
    int8_draft: bool = False,
    draft_vocab: int = 0,
    draft_precision: DraftPrecisionOpt = "auto",
    out: Annotated[Path | None, typer.Option(help="also write the JSON here")] = None,
    adapter: Annotated[Path | None, typer.Option(
        help="a trained LoRA adapter directory (e.g. a registry artifact under the adapter dir) for the draft's "
             "spec rows; with --draft-vocab N if it was trained on a restricted head (torch engine)")] = None,
):
    """Side-by-side sweep: ours (spec at each γ, plain) vs transformers (plain, assisted).

    Prints a table to stderr and the JSON to stdout.
    """
    from decoder.bench import BenchConfig, run_bench

    if quick:
        workloads, prompts, gammas, sampling, max_new_tokens = "prose,code", 1, "2,4", "greedy", 32
    try:
        cfg = BenchConfig(parse_gammas(gammas), tuple(s.strip() for s in sampling.split(",")), max_new_tokens, hf,
                          proposers=_check_proposers(proposers))
        ps = _bench_prompts(cfg, workloads, prompts, max_new_tokens)
        _check_precision(draft_precision)
        _check_engine(engine)
        check_device(device)
        check_context(target, max_new_tokens)
        if llamacpp_peer:
            _peer_gguf(target)
        if adapter is not None and not (adapter / "adapter_config.json").is_file():
            raise ValueError(f"--adapter {str(adapter)!r}: no adapter_config.json there; pass a LoRA adapter "
                             f"directory (a registry artifact, e.g. out/demo/adapters/<run>/v3)")
        pair, dv, choice = _load(target, draft, device, int8_draft, draft_vocab, engine)
        adapter_note = apply_adapter(pair, choice, adapter) if adapter else None
        if adapter_note:
            err.log(f"adapter {adapter}: {adapter_note}")
        dec = _decoder(pair, dv, draft_precision, choice)
        if llamacpp_peer or (llamacpp_peer is None and choice.name == "llamacpp"):
            cfg.llamacpp = str(_peer_gguf(target))
    except (ValueError, RuntimeError) as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from e
    partial = out.with_suffix(".rows.jsonl") if out else None
    if partial:
        partial.write_text("")

    def on_row(row: dict) -> None:
        err.log(f"{row['workload']} {row['sampling']} {row['method']} γ={row['gamma']}: "
                f"{row['tokens_per_s']} tok/s (×{row['speedup_vs_plain']} plain)")
        if partial:
            with partial.open("a") as f:
                f.write(json.dumps(row) + "\n")

    with err.status("benchmarking") as st:
        result = run_bench(dec, ps, cfg, progress=lambda s: st.update(f"benchmarking: {s}"), on_row=on_row)
    result["config"] = {"target": target, "draft": draft, "workloads": workloads, "prompts": prompts,
                        "gammas": cfg.gammas, "sampling": cfg.sampling, "max_new_tokens": max_new_tokens,
                        "int8_draft": int8_draft, "draft_vocab": draft_vocab, "draft_precision": draft_precision,
                        "engine": choice.name, "engine_reason": choice.reason, "proposers": cfg.proposers,
                        "llamacpp_peer": cfg.llamacpp, "adapter": str(adapter) if adapter else None,
                        "adapter_applied": adapter_note}
    print_table(result, err)
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        out.write_text(text)


def _bench_prompts(cfg, workloads: str, prompts: int, max_new_tokens: int) -> list:
    """The bench's prompts, ``prompts`` per workload; ValueError naming a bad option."""
    from decoder.workloads import get_workload

    if prompts < 1:
        raise ValueError(f"--prompts {prompts}: must be >= 1")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
    bad = [s for s in cfg.sampling if s not in ("greedy", "t0.7-p0.9", "t1.0")]
    if bad:
        raise ValueError(f"unknown sampling {bad}: use greedy, t0.7-p0.9, t1.0")
    ps = []
    for w in workloads.split(","):
        got = get_workload(w.strip(), prompts)
        if not got:
            raise ValueError(f"workload {w.strip()!r} has no prompts (humaneval needs ../shared/data/humaneval.jsonl.gz; "
                             f"a JSONL file needs at least one row)")
        ps.extend(got)
    return ps


def _peer_gguf(target: str) -> Path:
    """The GGUF llama-cpp-python's own plain generation runs on; ValueError for a non-GGUF target."""
    from decoder.engines.registry import target_gguf

    gguf = target_gguf(target)
    if gguf is None:
        raise ValueError(f"--llamacpp-peer needs a GGUF target (a built-in name or a .gguf path), not {target!r}")
    return gguf


def print_table(result: dict, console: Console) -> None:
    t = Table(title="speculative decoding vs plain vs transformers (tokens/s end to end)")
    for c in ("workload", "sampling", "method", "γ", "tok/s", "×plain", "α", "τ", "acc", "c", "pred×", "=plain"):
        t.add_column(c)
    f = lambda x: "" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))  # noqa: E731
    for r in result["rows"]:
        t.add_row(r["workload"], r["sampling"], r["method"] + (f" {r['proposer']}" if r.get("proposer") else ""),
                  str(r["gamma"]), f(r["tokens_per_s"]),
                  f(r["speedup_vs_plain"]), f(r.get("alpha")), f(r.get("tau")), f(r.get("acceptance_rate")),
                  f(r.get("c")), f(r.get("predicted_speedup")), f(r.get("matches_plain")))
    console.print(t)
    s = Table(title="decision: speculate only where it beats plain decoding")
    for c in ("workload", "sampling", "best γ", "×plain", "ours plain / hf plain", "ours spec / hf assisted", "speculate", "why"):
        s.add_column(c)
    for r in result["summary"]:
        s.add_row(r["workload"], r["sampling"], f(r["best_gamma"]), f(r["best_speedup_vs_plain"]),
                  f(r["ours_plain_vs_hf_plain"]), f(r["ours_spec_vs_hf_assisted_median"]),
                  "on" if r["speculate"] else "off", r["why"])
    console.print(s)


def register(app: typer.Typer) -> None:
    app.command()(generate)
    app.command()(bench)


if __name__ == "__main__":  # pragma: no cover
    a = typer.Typer()
    register(a)
    a()
    sys.exit(0)
