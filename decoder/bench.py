"""Side-by-side benchmark: our speculative decoding vs our plain decoding vs transformers.

For each workload and sampling policy, on the same pair and prompts, in one run:

- ``plain``: our loop at γ = 0 (the same code path as speculation);
- ``spec``: our loop at each γ;
- ``hf_plain``: ``target.generate`` without an assistant;
- ``hf_assisted``: transformers' assisted generation, ``generate(assistant_model=draft)`` with
  ``num_assistant_tokens=γ`` and the constant schedule (equal γ and draft);
- ``llamacpp_plain`` (``BenchConfig.llamacpp``): llama-cpp-python's own plain generation,
  ``Llama.create_completion`` on the same GGUF, the same prompt ids, the same thread count and
  flash-attention setting, EOS banned by logit bias (as ``ignore_eos``), its prompt cache reset
  before every call.

Spec rows run each proposer of ``BenchConfig.proposers`` (``draft``, ``ngram``) at each γ. The
n-gram proposer's history is frozen at its state when the bench starts (empty in
``daemonctl bench``), so it looks up the request's own context only (prompt lookup decoding):
a prompt's plain output, decoded just before, must not be proposed back to it.

Every method decodes exactly ``max_new_tokens`` tokens (EOS ignored, ``min_new_tokens`` for
transformers), so tokens/s compare like with like. Speeds are end-to-end (prefill included) for
all methods; ``goodput`` is our decode-only emitted tokens per ms.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from decoder.engines.llamacpp_lib import llama_call
from decoder.engines.registry import torch_threads_for
from decoder.metrics import AcceptanceCounts
from decoder.sampling import SamplingParams, predicted_speedup
from decoder.proposers.registry import DEFAULT_PROPOSER, PROPOSERS
from decoder.speculative import DecodeRequest, FixedGamma, SpeculativeDecoder
from decoder.workloads import Prompt
from store.jsonsafe import nan_none

SAMPLING = {
    "greedy": SamplingParams(),
    "t0.7-p0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "t1.0": SamplingParams(temperature=1.0),
}


@dataclass
class BenchConfig:
    gammas: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    sampling: tuple[str, ...] = ("greedy", "t0.7-p0.9", "t1.0")
    max_new_tokens: int = 64
    hf: bool = True  # include transformers' plain and assisted generation
    seed: int = 0
    proposers: tuple[str, ...] = (DEFAULT_PROPOSER,)
    llamacpp: str | None = None  # a GGUF path: add llama-cpp-python's plain generation as a peer
    threads: int | None = None  # the peer's threads (default: the target engine's, else os.cpu_count())
    near_tie_positions: int = 8  # greedy: batched-vs-one-token logit differences over this many positions per prompt


class LlamaCppPeer:
    """llama-cpp-python's high-level generation (``Llama.create_completion``) on a GGUF file.

    Raises:
        decoder.engines.base.EngineError: llama-cpp-python is missing.
    """

    def __init__(self, gguf: str, threads: int | None = None, n_ctx: int = 4096):
        import os

        from decoder.engines.llamacpp_lib import llama_extra_buffers

        llama_extra_buffers(gguf)  # logging off, backend initialised, the same weight buffers as ours
        from llama_cpp import Llama

        from decoder.models.gguf_export import SPLIT_KEY

        self.threads = int(threads or os.cpu_count() or 1)
        kw = dict(model_path=str(gguf), n_ctx=n_ctx, n_threads=self.threads, n_threads_batch=self.threads,
                  flash_attn=True, verbose=False)  # flash attention as ours; V cache at llama.cpp's f16 (users' default)
        self.llm = Llama(**kw)
        split = self.llm.metadata.get(SPLIT_KEY)
        if split:  # a split Q4_1 file (decoder.models.gguf_export.q4_1_split_gguf): with its offset adapter, as ours runs it
            self.llm.close()
            from decoder.engines.llamacpp import LlamaCppEngine

            # our engine checks the adapter (present, loadable, this model's): llama-cpp-python
            # does not, and a refused adapter crashed it at the first decode
            LlamaCppEngine(gguf, n_ctx=64, threads=1).close()
            self.llm = Llama(**kw, lora_path=str(Path(gguf).parent / split), lora_scale=1.0)
        self.eos = [t for t in {self.llm.token_eos(), getattr(self.llm, "token_eot", lambda: -1)()} if t >= 0]

    def generate(self, ids: list[int], params: SamplingParams, n: int, seed: int) -> tuple[list[int], float, int]:
        """``n`` new tokens after ``ids``: (the first n - 1 token ids, end-to-end ms, tokens
        generated). The last token is sampled but never fed back, so llama.cpp's context holds
        only the first n - 1; they are what the equality check compares."""
        greedy = params.greedy
        self.llm.reset()  # no prompt-prefix reuse from the previous call
        t0 = time.perf_counter()
        out = llama_call(lambda: self.llm.create_completion(
            prompt=list(ids), max_tokens=n, temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p, top_k=0 if greedy else (params.top_k or 0), min_p=0.0,
            typical_p=1.0, repeat_penalty=1.0, seed=seed, logit_bias={t: float("-inf") for t in self.eos}))
        ms = (time.perf_counter() - t0) * 1e3
        n_out = out["usage"]["completion_tokens"]
        return self.llm._input_ids[len(ids):].tolist()[:n_out], ms, n_out


UPSTREAM_KERNELS = {"GGML_X86_TILED": "0", "GGML_AMX_VNNI_MAX_ROWS": "1", "GGML_FA_BF16V_BLOCKED": "0"}
"""scripts/patches' switches, each set to upstream's kernel (``decoder.engines.llamacpp_lib.PATCH_SWITCHES``)."""


def _peer_worker(conn, gguf: str, threads: int, n_ctx: int, env: dict[str, str]) -> None:
    """A :class:`LlamaCppPeer` in a process of its own (``env`` set before llama.cpp loads): answers
    ``(ids, params, n, seed)`` with :meth:`LlamaCppPeer.generate`'s tuple, or ``("error", text)``;
    None ends it."""
    import logging
    import os

    import structlog

    os.environ.update(env)
    # the parent's console is the user's: the child says nothing below a warning there
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        peer = LlamaCppPeer(gguf, threads, n_ctx)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", peer.threads))
    while (job := conn.recv()) is not None:
        try:
            conn.send(peer.generate(*job))
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}"))
    peer.llm.close()


class UpstreamLlamaCppPeer:
    """:class:`LlamaCppPeer` with upstream llama.cpp's kernels: in a process of its own with every
    patch of ``scripts/patches`` switched off (:data:`UPSTREAM_KERNELS`), so it generates as the
    llama.cpp users install does (the same build, none of draftd's kernels; in this process the
    patched one-row kernels would speed the peer up too). ``generate`` times inside the child, so
    the pipe is not in its ms. Use as a context manager or call :meth:`close`.

    Raises:
        decoder.engines.base.EngineError: the child could not load the file (its error's text).
    """

    def __init__(self, gguf: str, threads: int | None = None, n_ctx: int = 4096):
        import multiprocessing
        import os

        from decoder.engines.base import EngineError

        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: ggml reads the switches at its first use
        self._conn, child = ctx.Pipe()
        self.threads = int(threads or os.cpu_count() or 1)
        self._proc = ctx.Process(target=_peer_worker, args=(child, str(gguf), self.threads, n_ctx, UPSTREAM_KERNELS),
                                 daemon=True, name="llamacpp-peer")
        self._proc.start()
        child.close()
        status = self._recv()
        if status[0] != "ready":
            self.close()
            raise EngineError(f"llama.cpp peer on {gguf} did not start: {status[1]}")

    def _recv(self):
        from decoder.engines.base import EngineError

        try:
            return self._conn.recv()
        except EOFError:
            raise EngineError(f"llama.cpp peer process exited (code {self._proc.exitcode})") from None

    def generate(self, ids: list[int], params: SamplingParams, n: int, seed: int) -> tuple[list[int], float, int]:
        """As :meth:`LlamaCppPeer.generate`, in the child."""
        from decoder.engines.base import EngineError

        self._conn.send((list(ids), params, n, seed))
        out = self._recv()
        if out and out[0] == "error":
            raise EngineError(f"llama.cpp peer: {out[1]}")
        return out

    def close(self) -> None:
        """Stop the child (idempotent)."""
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _hf_generate(model, draft, ids: list[int], params: SamplingParams, n: int, gamma: int | None, seed: int):
    x = torch.tensor([ids])
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=not params.greedy, pad_token_id=0)
    if not params.greedy:
        kw.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
    else:
        kw.update(temperature=None, top_p=None, top_k=None)
    if gamma is not None:
        kw.update(assistant_model=draft, num_assistant_tokens=gamma, num_assistant_tokens_schedule="constant",
                  assistant_confidence_threshold=0.0)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, **kw)
    ms = (time.perf_counter() - t0) * 1e3
    return out[0, len(ids):].tolist(), ms


def run_bench(
    decoder: SpeculativeDecoder,
    prompts: Iterable[Prompt],
    cfg: BenchConfig,
    progress: Callable[[str], None] | None = None,
    on_row: Callable[[dict], None] | None = None,
) -> dict:
    """Run the sweep and return ``{"rows": [...], "summary": [...], "machine": {...}, "kernels": {...}}``
    (``kernels``: the decoder's measured kernel choices: small-M calibration, draft precision).

    One row per (workload, sampling, method, γ), pooled over the workload's prompts. Each prompt
    runs every method back to back before the next prompt starts (paired measurement: drift in
    the machine's speed hits all methods alike). Fields:
    tokens, ms (end-to-end), tokens_per_s, speedup_vs_plain (ours plain, pooled tokens over pooled
    ms), for spec rows also speedup_per_prompt (each prompt's spec tokens/s over its own plain
    tokens/s) and its median, alpha, tau,
    acceptance_rate, c (draft ms per draft token / plain ms per step), predicted_speedup
    (Leviathan et al. Theorem 3.8 from the measured α, γ, c), and for greedy spec rows
    ``matches_plain`` (every prompt token-identical to our plain greedy output).
    ``on_row`` is called with each row as soon as it is measured (so a long sweep that is cut
    short still leaves its rows behind).

    Raises:
        ValueError: ``prompts`` is empty, a prompt tokenises to nothing, or ``cfg.sampling``
            names a policy not in ``SAMPLING``.
    """
    enc_by_wl = _encode(decoder.tokenizer, prompts, cfg)
    gammas = list(dict.fromkeys(cfg.gammas))  # each γ once, in the order given
    rows: list[dict] = []

    def add(row: dict) -> None:
        rows.append(row)
        if on_row:
            on_row(row)

    say = progress or (lambda s: None)
    bad = [p for p in cfg.proposers if p not in PROPOSERS]
    if bad or not cfg.proposers:
        raise ValueError(f"BenchConfig.proposers={cfg.proposers!r}: use one or more of {PROPOSERS}")
    # the peer's context is the target engine's: llama-cpp-python refuses a prompt of n_ctx tokens
    # and silently shortens max_tokens near it, so a smaller one failed or under-generated mid-sweep;
    # upstream's kernels, in a process of its own: what a llama.cpp user runs
    peer = UpstreamLlamaCppPeer(cfg.llamacpp, cfg.threads or getattr(decoder.engine, "threads", None),
                                n_ctx=getattr(decoder.engine, "context_length", None) or 4096) if cfg.llamacpp else None
    try:
        return _sweep(decoder, enc_by_wl, gammas, cfg, say, add, rows, peer)
    finally:
        if peer is not None:
            peer.close()


def _sweep(decoder, enc_by_wl, gammas, cfg, say, add, rows, peer) -> dict:
    """:func:`run_bench`'s measurement, every workload and sampling policy, with its peer open."""
    frozen_history = decoder.ngram_history.copy()
    frozen_gate = decoder.ngram_gate.copy() if decoder.ngram_gate is not None else None
    # Warm-up: first calls pay one-off allocator and kernel selection costs.
    warm = next(iter(enc_by_wl.values()))[0]
    decoder.generate(DecodeRequest(warm, max_new_tokens=min(4, cfg.max_new_tokens), gamma=2, ignore_eos=True))
    torch_threads = torch.get_num_threads()  # what the hf rows run with
    # On llama.cpp the decoder's torch work runs single-threaded, for the whole sweep (between our
    # requests too: torch workers still spinning from a 2-thread op slowed the next decode)
    with torch_threads_for(decoder.engine):
        for wl, enc in enc_by_wl.items():
            for sname in cfg.sampling:
                m = _measure(decoder, wl, sname, enc, gammas, cfg, say, peer, frozen_history, torch_threads,
                             gate=frozen_gate)
                for row in _rows(wl, sname, m, gammas, cfg):
                    add(row)
    kernels = {"small_m_calibration": decoder.small_m_calibration, "draft_precision": decoder.draft_precision,
               "draft_precision_calibration": decoder.draft_precision_calibration,
               "engine": decoder.engine.describe(),
               "draft_engine": decoder.draft_engine.describe() if decoder.draft_engine is not None else None}
    return {"rows": rows, "summary": summarize(rows), "machine": machine_info(), "kernels": kernels}


def _encode(tok, prompts: Iterable[Prompt], cfg: BenchConfig) -> dict[str, list[list[int]]]:
    """Every prompt's token ids, grouped by workload, checked before the first row is measured
    (so an empty one fails here, not mid-sweep)."""
    prompts = list(prompts)
    if not prompts:
        raise ValueError("run_bench got no prompts: pass at least one Prompt (a workload name from "
                         "decoder.workloads, or prompts of your own)")
    unknown = [s for s in cfg.sampling if s not in SAMPLING]
    if unknown:
        raise ValueError(f"BenchConfig.sampling: unknown {unknown}; choose from {sorted(SAMPLING)}")
    enc_by_wl: dict[str, list[list[int]]] = {}
    for p in prompts:
        enc_by_wl.setdefault(p.workload, []).append(p.token_ids(tok))
    empty = [(wl, i) for wl, enc in enc_by_wl.items() for i, ids in enumerate(enc) if not ids]
    if empty:
        raise ValueError(f"prompts {empty} (workload, index) tokenise to nothing; give each some text")
    return enc_by_wl


def _measure(decoder: SpeculativeDecoder, wl: str, sname: str, enc: list[list[int]], gammas: list[int],
             cfg: BenchConfig, say: Callable[[str], None], peer: "LlamaCppPeer | None" = None,
             history=None, hf_threads: int | None = None, gate=None) -> dict:
    """One (workload, sampling) cell: per prompt, every method back to back (plain, hf_plain,
    llamacpp_plain, then each proposer x γ's spec and hf_assisted), so a machine that speeds up or
    slows down during the sweep shifts all methods alike instead of favouring whichever ran in the
    quiet minutes; every run prefills its prompt (``cache_prompt=False``). Returns the pooled counts and times per method."""
    base = SAMPLING[sname]
    plain_counts, plain_ms = AcceptanceCounts(), 0.0
    keys = [(p, g) for p in cfg.proposers for g in gammas]
    spec = {k: {"counts": AcceptanceCounts(), "ms": 0.0, "same": True, "ratios": [], "diffs": []} for k in keys}
    hf_plain, hf = [0, 0.0], {g: [0, 0.0] for g in gammas}
    peer_m = {"tokens": 0, "ms": 0.0, "ratios": [], "same": [], "diffs": []}
    batched_diff: list[float] = []

    def run(req, policy):
        if history is not None:  # every request sees the same frozen n-gram history and gate (row order is not
            decoder.ngram_history = history.copy()  # an input: a gate learning across rows would make it one)
            decoder.ngram_gate = gate.copy() if gate is not None else None
        return decoder.generate(req, policy)

    def hf_run(*args):  # transformers at torch's own thread count, as its users run it
        before = torch.get_num_threads()
        torch.set_num_threads(hf_threads or before)
        try:
            return _hf_generate(*args)
        finally:
            torch.set_num_threads(before)

    for i, ids in enumerate(enc):
        params = SamplingParams(base.temperature, base.top_p, base.top_k, seed=cfg.seed + i)
        say(f"{wl} {sname} plain prompt {i + 1}/{len(enc)}")
        r = run(DecodeRequest(ids, params, cfg.max_new_tokens, gamma=0, ignore_eos=True, workload=wl, cache_prompt=False), FixedGamma(0))
        plain_out = r.output_ids
        plain_counts.merge(r.counts)
        plain_ms += r.latency_ms
        plain_tps_i = len(r.output_ids) / r.latency_ms  # this prompt's plain tokens/ms
        if cfg.hf:
            say(f"{wl} {sname} hf_plain prompt {i + 1}/{len(enc)}")
            out, t = hf_run(decoder.target, decoder.draft, ids, base, cfg.max_new_tokens, None, cfg.seed + i)
            hf_plain[0] += len(out)
            hf_plain[1] += t
        if peer is not None:
            say(f"{wl} {sname} llamacpp_plain prompt {i + 1}/{len(enc)}")
            out, t, n_out = peer.generate(ids, base, cfg.max_new_tokens, cfg.seed + i)
            peer_m["tokens"] += n_out
            peer_m["ms"] += t
            peer_m["ratios"].append(plain_tps_i / (n_out / t))
            if base.greedy:
                d = _first_diff(out, plain_out[: len(out)])
                peer_m["same"].append(d is None)
                if d is not None:
                    peer_m["diffs"].append({"prompt": i, "first_diff_index": d,
                                            "top2_margin": _top2_margin(decoder, ids, plain_out, d)})
        if base.greedy and cfg.near_tie_positions:
            batched_diff.append(batched_vs_one_token(decoder, ids, plain_out[: cfg.near_tie_positions]))
        for prop, g in keys:
            say(f"{wl} {sname} spec {prop} γ={g} prompt {i + 1}/{len(enc)}")
            r = run(DecodeRequest(ids, params, cfg.max_new_tokens, gamma=g, ignore_eos=True, workload=wl,
                                  proposer=prop, cache_prompt=False), FixedGamma(g))
            sg = spec[(prop, g)]
            sg["counts"].merge(r.counts)
            sg["ms"] += r.latency_ms
            sg["same"] &= r.output_ids == plain_out
            sg["ratios"].append(len(r.output_ids) / r.latency_ms / plain_tps_i)
            if base.greedy and r.output_ids != plain_out:
                d = _first_diff(r.output_ids, plain_out)
                sg["diffs"].append({"prompt": i, "first_diff_index": d,
                                    "top2_margin": _top2_margin(decoder, ids, plain_out, d)})
            if cfg.hf and prop == cfg.proposers[0]:
                say(f"{wl} {sname} hf_assisted γ={g} prompt {i + 1}/{len(enc)}")
                out, t = hf_run(decoder.target, decoder.draft, ids, base, cfg.max_new_tokens, g, cfg.seed + i)
                hf[g][0] += len(out)
                hf[g][1] += t
    if history is not None:
        decoder.ngram_history = history.copy()
        decoder.ngram_gate = gate.copy() if gate is not None else None
    return {"greedy": base.greedy, "plain_counts": plain_counts, "plain_ms": plain_ms, "spec": spec,
            "hf_plain": hf_plain, "hf": hf, "peer": peer_m if peer is not None else None,
            "batched_diff": max(batched_diff) if batched_diff else None}


def _first_diff(a: list[int], b: list[int]) -> int | None:
    d = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return min(len(a), len(b)) if d is None and len(a) != len(b) else d


@torch.inference_mode()
def _top2_margin(decoder: SpeculativeDecoder, ids: list[int], plain_out: list[int], d: int) -> float | None:
    """The target's top-2 logit margin (one-token logits, as plain decoding saw them) at output
    index ``d`` of the plain greedy output: a near-tie there explains a greedy mismatch."""
    if d is None or d >= len(plain_out):
        return None
    seq = decoder.engine.start()
    ctx = list(ids) + plain_out[:d]
    if len(ctx) > 1:
        seq.forward(ctx[:-1], 1)
    top = torch.topk(seq.forward(ctx[-1:], 1)[0].float(), 2).values
    return round(float(top[0] - top[1]), 5)


@torch.inference_mode()
def batched_vs_one_token(decoder: SpeculativeDecoder, ids: list[int], cont: list[int]) -> float:
    """Largest |logit| difference between the same positions' logits computed in batches of
    other shapes: ``cont`` fed in one batch (as verification does) vs one token at a time (as
    plain decoding does), after the prompt ``ids``; and the prompt's last position inside the
    whole prompt's batch (as llama-cpp-python's generation computes it) vs fed alone after the
    rest (as our decoder does). The float noise a greedy mismatch's top-2 margin is compared with."""
    if not cont:
        return 0.0
    ctx = list(ids) + list(cont)
    n = len(cont)
    fed = ctx[len(ids) - 1 : len(ids) - 1 + n]  # the pending prompt token, then cont[:-1]
    a = decoder.engine.start()  # one sequence at a time: a llama.cpp engine's start() clears the last
    if len(ids) > 1:
        a.forward(ctx[: len(ids) - 1], 1)
    batched = a.forward(fed, n).float()
    b = decoder.engine.start()
    if len(ids) > 1:
        b.forward(ctx[: len(ids) - 1], 1)
    one = torch.stack([b.forward([t], 1)[0].float() for t in fed])
    diff = float((batched - one).abs().max())
    if len(ids) > 1:
        whole = decoder.engine.start().forward(list(ids), 1)[0].float()  # the prompt in one batch
        diff = max(diff, float((whole - one[0]).abs().max()))
    return round(diff, 5)


def _rows(wl: str, sname: str, m: dict, gammas: list[int], cfg: BenchConfig) -> list[dict]:
    """The cell's rows: plain, hf_plain, then per γ spec and hf_assisted, rates against our plain."""
    plain_counts = m["plain_counts"]
    plain_tps = plain_counts.num_emitted_tokens / m["plain_ms"] * 1e3
    plain_step_ms = plain_counts.decode_ms / max(plain_counts.num_steps, 1)
    rows = [_row(wl, sname, "plain", 0, plain_counts, m["plain_ms"], plain_tps, None)]
    rows[0]["batched_vs_one_token_max_logit_diff"] = m.get("batched_diff")
    if cfg.hf:
        rows.append(_hf_row(wl, sname, "hf_plain", 0, *m["hf_plain"], plain_tps))
    peer = m.get("peer")
    peer_tps = None
    if peer is not None:
        row = _hf_row(wl, sname, "llamacpp_plain", 0, peer["tokens"], peer["ms"], plain_tps)
        peer_tps = row["tokens_per_s"]
        row["ours_plain_vs_peer_per_prompt"] = [nan_none(x, 3) for x in peer["ratios"]]
        row["ours_plain_vs_peer_median"] = nan_none(statistics.median(peer["ratios"]), 3) if peer["ratios"] else None
        if m["greedy"]:
            row["matches_ours_plain_share"] = round(sum(peer["same"]) / len(peer["same"]), 3) if peer["same"] else None
            row["mismatches"] = peer["diffs"]
        rows.append(row)
    for prop in cfg.proposers:
        for g in gammas:
            sg = m["spec"][(prop, g)]
            sc = sg["counts"]
            c = sc.draft_ms_per_draft_token / plain_step_ms
            row = _row(wl, sname, "spec", g, sc, sg["ms"], plain_tps, c)
            row["proposer"] = prop
            # what a verification step costs in plain steps (1 + per-token cost x proposals): the
            # Leviathan prediction assumes 1; on a compute-bound CPU engine it grows with γ
            v = (sc.verify_ms / sc.num_steps) / plain_step_ms if sc.num_steps and plain_step_ms else float("nan")
            row["verify_cost_vs_plain_step"] = nan_none(v, 4)
            row["mean_proposal_length"] = nan_none(sc.num_draft_tokens / sc.num_steps if sc.num_steps else float("nan"), 3)
            # the measured decomposition: tokens per step over (draft + verification) cost per
            # step, in plain steps; Leviathan's prediction above assumes v = 1 and a proposal
            # at every step
            mpl = sc.num_draft_tokens / sc.num_steps if sc.num_steps else float("nan")
            tau = sc.mean_accepted_length
            row["speedup_from_measured_costs"] = (
                nan_none(tau / (mpl * c + v), 4) if not any(math.isnan(x) for x in (tau, mpl, c, v)) else None)
            row["speedup_per_prompt"] = [nan_none(x, 3) for x in sg["ratios"]]
            row["speedup_per_prompt_median"] = nan_none(statistics.median(sg["ratios"]), 3)
            if peer_tps:
                row["speedup_vs_llamacpp_plain"] = round(row["tokens_per_s"] / peer_tps, 3)
            row["matches_plain"] = sg["same"] if m["greedy"] else None
            if m["greedy"]:
                n = len(sg["ratios"])
                row["matches_plain_share"] = round((n - len(sg["diffs"])) / n, 3) if n else None
                row["mismatches"] = sg["diffs"]
            rows.append(row)
            if cfg.hf and prop == cfg.proposers[0]:
                rows.append(_hf_row(wl, sname, "hf_assisted", g, *m["hf"][g], plain_tps))
    return rows


def _row(wl, sname, method, g, counts: AcceptanceCounts, ms, plain_tps, c):
    tps = counts.num_emitted_tokens / ms * 1e3
    a = counts.alpha
    return {
        "workload": wl, "sampling": sname, "method": method, "gamma": g,
        "tokens": counts.num_emitted_tokens, "ms": round(ms, 1), "tokens_per_s": round(tps, 3),
        "speedup_vs_plain": round(tps / plain_tps, 3),
        "goodput_tokens_per_ms": nan_none(counts.goodput, 4),
        "alpha": nan_none(a, 4), "tau": nan_none(counts.mean_accepted_length, 4), "acceptance_rate": nan_none(counts.acceptance_rate, 4),
        "acceptance_per_position": [nan_none(x, 4) for x in counts.acceptance_per_position],
        "draft_ms": round(counts.draft_ms, 1), "verify_ms": round(counts.verify_ms, 1),
        "c": nan_none(c, 4),
        "predicted_speedup": nan_none(predicted_speedup(a, g, c), 4) if c is not None and not math.isnan(a) else None,
    }


def _hf_row(wl, sname, method, g, n_tok, ms, plain_tps):
    tps = n_tok / ms * 1e3
    return {"workload": wl, "sampling": sname, "method": method, "gamma": g, "tokens": n_tok, "ms": round(ms, 1),
            "tokens_per_s": round(tps, 3), "speedup_vs_plain": round(tps / plain_tps, 3)}


def summarize(rows: list[dict]) -> list[dict]:
    """Per (workload, sampling): best γ for us, and the ratios the issue's targets name:
    our plain vs transformers' plain, our spec vs transformers' assisted at equal γ."""
    out = []
    keys = sorted({(r["workload"], r["sampling"]) for r in rows})
    for wl, s in keys:
        rs = [r for r in rows if r["workload"] == wl and r["sampling"] == s]
        get = {(r["method"], r["gamma"]): r for r in rs}
        spec = [r for r in rs if r["method"] == "spec"]
        best = max(spec, key=lambda r: r["tokens_per_s"]) if spec else None
        plain = get.get(("plain", 0))
        hf_plain = get.get(("hf_plain", 0))
        ratios = [r["tokens_per_s"] / get[("hf_assisted", r["gamma"])]["tokens_per_s"]
                  for r in spec if ("hf_assisted", r["gamma"]) in get]
        # Speculation can only pay when a step emits more than one token (τ > 1), and only up to
        # Leviathan's prediction (it prices a verification at one plain step, the least it costs):
        # a faster row beyond either bound is timing noise (a plain row slowed by the host), not a gain.
        faster = bool(best and plain and best["tokens_per_s"] > plain["tokens_per_s"])
        tau_ok = bool(best and (best["tau"] or 1.0) > 1.0)
        pred = best.get("predicted_speedup") if best else None
        pred_ok = pred is None or pred > 1.0
        speculate = faster and tau_ok and pred_ok
        if not (best and plain):
            why = "no spec rows"
        else:
            why = (f"γ={best['gamma']} emits {best['tokens_per_s']:.2f} tok/s vs plain {plain['tokens_per_s']:.2f}"
                   f" (α={best['alpha']}, c={best['c']})")
            if faster and not tau_ok:
                why += "; but τ = 1 (no proposal accepted): timing noise, off"
            elif faster and not pred_ok:
                why += f"; but Leviathan's bound is {pred:.2f}x < 1: timing noise, off"
        out.append({
            "workload": wl, "sampling": s,
            "plain_tokens_per_s": plain and plain["tokens_per_s"],
            "best_gamma": best and best["gamma"], "best_speedup_vs_plain": best and best["speedup_vs_plain"],
            "alpha": best and best["alpha"],
            "ours_plain_vs_hf_plain": round(plain["tokens_per_s"] / hf_plain["tokens_per_s"], 3)
            if plain and hf_plain else None,
            "ours_spec_vs_hf_assisted_median": round(statistics.median(ratios), 3) if ratios else None,
            "speculate": speculate,
            "why": why,
        })
    return out


def machine_info() -> dict:
    import os

    return {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(), "cuda": torch.cuda.is_available()}
