"""`daemonctl generate` / `bench` limits checked before any model loads (exit 2, the option named):
a CUDA device on a torch that has none (an AssertionError traceback), γ past the API's cap of 64
(the command line ran what a client is refused), and --max-new-tokens past the target's context
window (refused only after the load)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import daemon.cli_decode as cli_decode
from daemon.cli import app
from daemon.cli_decode import check_device, check_generate_args, parse_gammas

# SmolLM2-135M-Instruct's context window (its model card and config: max_position_embeddings 8192)
SMOLLM2_CONTEXT = 8192


@pytest.fixture
def no_load(monkeypatch):
    """`generate`/`bench` that reach the model load exit 2 saying so (the load is what must not run)."""
    def load(*a, **kw):
        raise RuntimeError("the models were loaded")

    monkeypatch.setattr(cli_decode, "_load", load)


def _run(*args: str):
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, " ".join(r.output.split())


@pytest.fixture
def cpu_only_torch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_cuda_device_without_cuda_is_refused_before_loading(no_load, cpu_only_torch, device):
    for cmd in (["generate", "-p", "hi"], ["bench", "--quick"]):
        code, text = _run(*cmd, "--device", device)
        assert code == 2 and f"--device {device!r}: " in text and "use --device cpu" in text, text
        assert "the models were loaded" not in text


def test_a_cuda_index_past_the_visible_devices_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"--device 'cuda:2': 2 CUDA device\(s\) visible, cuda:0 to cuda:1"):
        check_device("cuda:2")
    assert check_device("cuda:1") == "cuda:1"


def test_other_devices(cpu_only_torch):
    assert check_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="--device 'gpu0' is not a torch device"):
        check_device("gpu0")
    with pytest.raises(ValueError, match="--device 'meta': draftd decodes on cpu, cuda"):
        check_device("meta")


def test_gamma_past_the_api_cap_is_refused_as_the_api_refuses_it(no_load):
    from daemon.serve import MAX_GAMMA

    assert MAX_GAMMA == 64
    code, text = _run("generate", "-p", "hi", "--gamma", "100000")
    assert code == 2 and "--gamma 100000: at most 64" in text, text
    check_generate_args("hi", 64, 8, 0.0, None, 0)  # the cap itself passes
    with pytest.raises(ValueError, match="--gamma 65: at most 64"):
        check_generate_args("hi", 65, 8, 0.0, None, 0)
    assert parse_gammas("1,64") == (1, 64)
    code, text = _run("bench", "--gammas", "2,65")
    assert code == 2 and "γ=65 is more than 64" in text, text


def test_max_new_tokens_past_the_context_is_refused_before_loading(no_load):
    code, text = _run("generate", "-p", "hi", "--max-new-tokens", "100000")
    assert code == 2, text
    assert (f"--max-new-tokens 100000: the target 'smollm2-135m' has a context window of {SMOLLM2_CONTEXT} tokens"
            in text and f"at most {SMOLLM2_CONTEXT - 1} new tokens fit" in text), text
    code, text = _run("generate", "-p", "hi", "--max-new-tokens", str(SMOLLM2_CONTEXT))
    assert code == 2 and f"--max-new-tokens {SMOLLM2_CONTEXT}: " in text, text
    # one token fewer fits a one-token prompt: it goes on to the load
    code, text = _run("generate", "-p", "hi", "--max-new-tokens", str(SMOLLM2_CONTEXT - 1))
    assert code == 2 and "the models were loaded" in text, text
    # a target whose context is not in a GGUF header is checked after the load, as before
    code, text = _run("generate", "-p", "hi", "--max-new-tokens", "100000", "--target", "/nonexistent/model-dir")
    assert "the models were loaded" in text, text
