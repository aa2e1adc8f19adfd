"""The running batch's KV cache: rows leave and join inside the layers' buffers, and every
row's next-token logits stay those of a forward pass over its whole sequence."""

from typing import Any

import pytest
import torch

from codeloop.engine.kv_batch import KVBatch, PrefixCache
from codeloop.engine.model import tiny_model

VOCAB = 97


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model(VOCAB, hidden_size=32, layers=2, heads=4).eval()


def _forward(model: Any) -> Any:
    def forward(cache: Any, **inputs: torch.Tensor) -> torch.Tensor:
        out = model(**inputs, use_cache=True, logits_to_keep=1, cache=cache)
        return out.logits[:, -1, :].float()

    return forward


def _prefill(model: Any, prompts: list[list[int]]) -> tuple[KVBatch, torch.Tensor]:
    return KVBatch.prefill(
        _forward(model), prompts, PrefixCache(0), pad_id=0, device=torch.device("cpu")
    )


def _expected(model: Any, sequences: list[list[int]]) -> torch.Tensor:
    """Each sequence's last-position logits from a forward pass over it alone, no cache."""
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([s])).logits[:, -1, :] for s in sequences])


def _decode(model: Any, batch: KVBatch, sequences: list[list[int]], steps: int) -> None:
    for step in range(steps):
        tokens = [(7 * len(s) + step) % VOCAB for s in sequences]
        for sequence, token in zip(sequences, tokens, strict=True):
            sequence.append(token)
        with torch.no_grad():
            logits = batch.decode(_forward(model), torch.tensor(tokens))
        assert torch.allclose(logits, _expected(model, sequences), atol=1e-4)


def _buffer(batch: KVBatch) -> int:
    return int(batch.cache.layers[0]._keys_buffer.data_ptr())


def test_rows_leave_and_join_in_place_with_every_rows_logits_unchanged(model: Any) -> None:
    rows = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    with torch.no_grad():
        batch, logits = _prefill(model, rows)
    assert torch.allclose(logits, _expected(model, rows), atol=1e-4)
    rows = [list(r) for r in rows]
    _decode(model, batch, rows, 3)
    buffer = _buffer(batch)

    batch.select([0, 2])  # the middle row leaves: the last moves up in the buffer
    rows = [rows[0], rows[2]]
    assert _buffer(batch) == buffer
    _decode(model, batch, rows, 2)

    joining = [[11, 12], [13, 14, 15]]  # narrower than the batch: into its spare rows
    with torch.no_grad():
        batch = batch.merge(_prefill(model, joining)[0])
    rows += [list(r) for r in joining]
    assert _buffer(batch) == buffer
    _decode(model, batch, rows, 2)

    batch.select([1, 2, 3])  # the longest row leaves: its columns are dropped
    rows = rows[1:]
    assert batch.mask.shape[1] == max(len(r) for r in rows)
    assert _buffer(batch) == buffer
    _decode(model, batch, rows, 2)

    wide = [list(range(20, 40))]  # wider than the batch: the view grows to the left
    with torch.no_grad():
        batch = batch.merge(_prefill(model, wide)[0])
    rows += [list(r) for r in wide]
    _decode(model, batch, rows, 70)  # past the buffers' room: they grow once more

    batch.select([3, 0])  # out of order: copied out of the buffers
    rows = [rows[3], rows[0]]
    _decode(model, batch, rows, 2)


def test_the_prefix_index_finds_what_a_scan_of_every_entry_finds() -> None:
    import random

    from codeloop.engine.kv_batch import BLOCK

    rng = random.Random(5)
    system = tuple(rng.randrange(4) for _ in range(2 * BLOCK + 3))  # shared by most entries

    def sequence() -> tuple[int, ...]:
        head = system[: rng.choice([0, 1, BLOCK - 1, BLOCK, len(system)])]
        return head + tuple(rng.randrange(3) for _ in range(rng.randrange(0, 4 * BLOCK)))

    cache = PrefixCache(max_tokens=40 * BLOCK)
    kept: dict[tuple[int, ...], None] = {}  # what a plain LRU list would hold
    for _ in range(400):
        ids = sequence()
        if not ids:
            continue
        cache.store(ids, [(torch.zeros(1, len(ids), 1), torch.zeros(1, len(ids), 1))])
        for key in [k for k in kept if ids[: len(k)] == k]:
            del kept[key]
        kept[ids] = None
        while sum(map(len, kept)) > cache.max_tokens:
            del kept[next(iter(kept))]
        assert cache.tokens == sum(map(len, kept))
        prompt = sequence() + (9,)
        expected = max((_shared(k, prompt[:-1]) for k in kept), default=0)
        n, entry = cache.lookup(prompt)
        assert n == expected
        assert (entry is None) == (n == 0)
        if entry is not None:
            assert entry.ids[:n] == prompt[:n]
            kept[entry.ids] = kept.pop(entry.ids)  # a hit is the most recently used


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
