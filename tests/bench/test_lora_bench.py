"""`codeloop bench lora`: both modes measured in their own processes, with figures that follow
from the model's shape."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from codeloop.data.tokenizer import train_tokenizer
from codeloop.engine.model import tiny_model

RANK = 2
# tiny_model(hidden 64, 2 layers): q, k, v, o are 64 x 64 and gate, up, down 64 <-> 256, so a
# layer's adapters hold RANK * (4 * (64 + 64) + 3 * (64 + 256)) = 1,472 * RANK parameters.
ADAPTER_PARAMETERS = 2 * 1472 * RANK
ADAPTER_TENSORS = 2 * 7 * 2


@pytest.mark.slow
def test_bench_lora_measures_both_modes(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(["What is 12 + 34? print(12 + 34)"] * 20, vocab_size=300)
    model_dir = tmp_path / "model"
    tiny_model(len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "lora.json"
    command = [sys.executable, "-m", "codeloop", "bench", "lora", "--model", str(model_dir)]
    options = ["--rank", str(RANK), "--sequences", "2", "--length", "48", "--steps", "1"]
    done = subprocess.run(
        [*command, *options, "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "full/LoRA" in done.stdout and "weight sync, MB" in done.stdout
    report = json.loads(out.read_text())
    full, lora = report["full"], report["lora"]
    assert lora["trained_parameters"] == ADAPTER_PARAMETERS
    assert full["trained_parameters"] == sum(
        p.numel() for p in tiny_model(len(tokenizer)).parameters()
    )
    # AdamW keeps two float32 moments a trained parameter and a step count a tensor
    assert lora["optimizer_bytes"] == 8 * ADAPTER_PARAMETERS + 4 * ADAPTER_TENSORS
    assert full["optimizer_bytes"] > 8 * full["trained_parameters"]
    # a sync sends the float32 adapters (CPU) and a safetensors header, nothing of the base
    assert 4 * ADAPTER_PARAMETERS < lora["sync_bytes"] < 4 * ADAPTER_PARAMETERS + 8192
    assert lora["checkpoint_bytes"] < full["checkpoint_bytes"]
    assert full["update_s"] > 0 and lora["update_s"] > 0
