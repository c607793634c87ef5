"""A load by config alone (no model) read the config's torch_dtype when its dtype was None, and
transformers 5 printed "`torch_dtype` is deprecated! Use `dtype` instead!" for it (README walk-through,
session 30). In a process of its own: transformers says it once per process."""

from __future__ import annotations

import subprocess
import sys


def test_a_load_by_config_reads_no_deprecated_field() -> None:
    script = (
        "from transformers import LlamaConfig\n"
        "from mooncake_store.integrations.transformers import _load_dtype\n"
        "print(_load_dtype(None, LlamaConfig(), None))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch.float32", result.stdout
    assert "deprecated" not in result.stderr, result.stderr
