"""`daemon.logging.configure` silences library noise no user can act on, and only that."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str, env_extra: dict | None = None) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


# in a fresh process: configure, then transformers imported, then the two warnings raised
CHECK = """
import warnings
from daemon.logging import configure
configure("console", LEVEL)
from transformers.utils import logging as tl
with warnings.catch_warnings(record=True) as caught:  # keeps the filters configure added
    warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
    warnings.warn("another FutureWarning", FutureWarning)
print(tl.is_progress_bar_enabled(), [str(c.message)[:7] for c in caught])
"""


def test_configure_turns_off_progress_bars_and_the_peft_deprecation_only():
    out = _run(CHECK.replace("LEVEL", '"warning"'))
    assert out == "False ['another']"


def test_a_users_own_setting_and_debug_keep_them():
    assert _run(CHECK.replace("LEVEL", '"warning"'), {"HF_HUB_DISABLE_PROGRESS_BARS": "0"}).startswith("True")
    assert _run(CHECK.replace("LEVEL", '"debug"')) == "True ['`is_gra', 'another']"
