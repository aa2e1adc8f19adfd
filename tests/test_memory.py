import sys
from types import SimpleNamespace

import pytest

from codeloop.config import Config
from codeloop.engine.model import tiny_model
from codeloop.memory import (
    micro_batch_tokens,
    resident_bytes,
    total_bytes,
    training_bytes_per_token,
    trim_when_above,
)
from codeloop.trainer import batch
from codeloop.trainer.batch import budget_tokens
from codeloop.trainer.distributed import World
from codeloop.trainer.learner import Learner


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_trims_only_above_the_share() -> None:
    assert 0 < resident_bytes() < total_bytes()
    assert trim_when_above(share=0.0)  # any process holds more than nothing
    assert not trim_when_above(share=1.0)  # none holds more than the whole machine


def test_an_automatic_micro_batch_holds_what_half_the_free_memory_does() -> None:
    smollm2 = SimpleNamespace(
        num_hidden_layers=30, hidden_size=576, intermediate_size=1536, vocab_size=49152
    )
    # activations 4 x (16 x 576 + 4 x 1536) x 30 = 1,843,200 bytes a token, logits 4 x 4 x 49,152
    assert training_bytes_per_token(smollm2) == (1_843_200, 786_432)
    assert micro_batch_tokens(smollm2, 20 * 2**30) == 4083  # 10 GiB / 2,629,632
    assert micro_batch_tokens(smollm2, 2**40) == 16384  # at most
    assert micro_batch_tokens(smollm2, 0) == 256  # at least
    # checkpointed: each layer's input (4 x 576 x 30) and one layer's whole (4 x 15,360)
    assert training_bytes_per_token(smollm2, checkpointed=True) == (130_560, 786_432)
    assert micro_batch_tokens(smollm2, 20 * 2**30, checkpointed=True) == 11709


def test_a_budget_left_at_zero_is_sized_to_the_memory_free(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model(32, hidden_size=32, layers=2)
    per_token = sum(training_bytes_per_token(model.config))
    monkeypatch.setattr(batch, "free_memory", lambda device: 2 * 1000 * per_token)
    assert budget_tokens(0, model, World()) == 1000
    assert budget_tokens(123, model, World()) == 123  # a budget set is kept
    cfg = Config()
    cfg.trainer.micro_batch_tokens = 0
    learner = Learner(model, cfg, World())
    assert learner.micro_batch_tokens == 1000
    monkeypatch.setattr(batch, "free_memory", lambda device: 0)
    assert learner.micro_batch_tokens == 1000  # settled at the first update
