"""`daemonctl serve` with continuous batching (serve.max_batch, issue 35 item 1), the real packaged
model: several streamed requests at once from the `openai` client all complete, each greedy text
equal to the same request served alone afterwards, and the heartbeat shows fused forwards."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import pytest

openai = pytest.importorskip("openai")

from conftest import DAEMONCTL, REDIS_URL, REPO, base_env, ctl, free_port, wait_healthy  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time, in a small village,",
           "List three colors:", "1, 2, 3, 4,"]


def test_concurrent_streamed_requests_complete_and_equal_their_output_served_alone(tmp_path, key_prefix):
    port = free_port()
    env = base_env(tmp_path / "state", free_port(), DRAFTD_REDIS__URL=REDIS_URL, DRAFTD_STORE__KEY_PREFIX=key_prefix,
                   DRAFTD_SERVE__HEARTBEAT_S="0.5", DRAFTD_SERVE__MAX_BATCH="4")
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([DAEMONCTL, "serve", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            cwd=REPO)
    try:
        wait_healthy(proc, port, lambda: (tmp_path / "serve.log").read_text()[-3000:])
        oc = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)

        def stream(prompt: str, i: int) -> str:
            chunks = oc.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=24 + 4 * i, temperature=0,
                                           stream=True, extra_body={"workload": ["prose", "code"][i % 2]})
            return "".join(ch.choices[0].text for ch in chunks)

        together: dict[int, str] = {}
        errors: list[BaseException] = []

        def client(i: int) -> None:
            try:
                together[i] = stream(PROMPTS[i], i)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        ths = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
        for t in ths:
            t.start()
        for t in ths:
            t.join(900)
        assert not errors, errors
        assert sorted(together) == list(range(len(PROMPTS)))
        time.sleep(1.5)  # a heartbeat after the load
        st = json.loads(ctl(env, "status", "--json").stdout)
        batch = next(h for h in st.get("serving", []) if h.get("requests_served", 0) >= len(PROMPTS))["batch"]
        assert batch["max_batch"] == 4 and any(int(k) >= 2 for k in batch["by_sequences"]), batch
        assert batch["step_token_budget"] == 64, batch  # serve.step_token_budget's default reaches the loop
        for i, p in enumerate(PROMPTS):  # alone, one after another
            assert stream(p, i) == together[i], i
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
    assert rc == 0, (tmp_path / "serve.log").read_text()[-3000:]


def test_the_step_token_budget_setting_is_checked_and_defaults_to_the_loops():
    from pydantic import ValidationError

    from daemon.settings import Settings
    from decoder.batching import STEP_TOKEN_BUDGET

    assert Settings().serve.step_token_budget == STEP_TOKEN_BUDGET == 64
    assert Settings(serve={"step_token_budget": None}).serve.step_token_budget is None
    with pytest.raises(ValidationError, match="step_token_budget"):
        Settings(serve={"step_token_budget": 0})
