"""The CPU decoding-attention kernel: hand-worked cases, SDPA's results on the shapes of real
models, nothing read outside a row's span, the slot decoder's logits with and without it, and
the fallback where no compiler builds it."""

import logging
import shutil
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from codeloop.engine import cpu_attention
from codeloop.engine.kv_batch import PrefixCache
from codeloop.engine.slot_cache import SlotBatch, SlotDecoder

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture
def kernel() -> cpu_attention.Kernel:
    built = cpu_attention.kernel()
    assert built is not None  # a machine with a compiler builds it
    return built


@pytest.fixture
def fresh_build(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> Iterator[None]:
    """kernel() looked up again (its result is cached), into an empty cache directory."""
    monkeypatch.setenv("CODELOOP_CACHE", str(tmp_path))
    cpu_attention.kernel.cache_clear()
    yield
    cpu_attention.kernel.cache_clear()


def _cache(rows: int, kv_heads: int, columns: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(2, rows, kv_heads, columns, dim).to(dtype)  # keys, values


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_column_gives_its_value_and_equal_scores_the_mean(
    kernel: cpu_attention.Kernel, dtype: torch.dtype
) -> None:
    keys, values = _cache(2, 1, 8, 16, dtype)
    query = torch.randn(2, 1, 3, 16).to(dtype)
    # row 0 sees column 5 only: softmax of one score is 1, so the value itself, exactly
    # row 1 sees columns 2 and 3 with equal keys: weights 1/2 each
    keys[1, 0, 3] = keys[1, 0, 2]
    out = kernel(query, keys, values, torch.tensor([5, 2]), torch.tensor([6, 4]), 0.25)
    assert out.dtype == dtype and out.shape == (2, 1, 3, 16)
    assert torch.equal(out[0, 0], values[0, 0, 5].expand(3, 16))
    mean = (values[1, 0, 2].float() + values[1, 0, 3].float()) / 2
    torch.testing.assert_close(out[1, 0].float(), mean.expand(3, 16), atol=1e-2, rtol=1e-2)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kv_heads", "group", "dim"),
    [(3, 3, 64), (1, 4, 256), (2, 2, 128), (2, 1, 96)],
    ids=["smollm2", "gemma3_270m", "dim128", "dim96_not_specialised"],
)
def test_spans_attend_as_sdpa_with_a_mask_and_nothing_outside_is_read(
    kernel: cpu_attention.Kernel, dtype: torch.dtype, kv_heads: int, group: int, dim: int
) -> None:
    rows, columns = 5, 96
    keys, values = _cache(rows + 2, kv_heads, columns, dim, dtype)  # more slots than rows
    query = torch.randn(rows, kv_heads, group, dim).to(dtype)
    starts = torch.tensor([0, 0, 7, 30, 95])
    ends = torch.tensor([1, 96, 40, 31, 96])
    inside = (torch.arange(columns) >= starts[:, None]) & (torch.arange(columns) < ends[:, None])
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.double(), keys[:rows].double(), values[:rows].double(),
        attn_mask=inside[:, None, None], scale=dim**-0.5,
    )  # fmt: skip
    outside = ~inside[:, None, :, None].expand(rows, kv_heads, columns, dim)
    keys[:rows][outside] = float("nan")  # read outside a span, NaN would reach the result
    values[:rows][outside] = float("nan")
    out = kernel(query, keys, values, starts, ends, dim**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@needs_compiler
def test_an_empty_span_gives_zeros_and_bad_shapes_are_refused(
    kernel: cpu_attention.Kernel,
) -> None:
    keys, values = _cache(1, 1, 4, 16, torch.float32)
    out = kernel(torch.ones(1, 1, 2, 16), keys, values, torch.tensor([2]), torch.tensor([2]), 1.0)
    assert torch.equal(out, torch.zeros(1, 1, 2, 16))
    assert kernel.handles(torch.bfloat16, 64, 3) and kernel.handles(torch.float32, 256, 4)
    assert not kernel.handles(torch.float16, 64, 3)  # not an element type it has
    assert not kernel.handles(torch.float32, 8, 3)  # not a multiple of 16
    assert not kernel.handles(torch.float32, 1024, 3)  # over MAX_DIM
    assert not kernel.handles(torch.float32, 64, 32)  # over MAX_GROUP
    with pytest.raises(RuntimeError, match="refused"):
        kernel(torch.ones(1, 1, 2, 8), keys[..., :8], values[..., :8], torch.tensor([0]),
               torch.tensor([2]), 1.0)  # fmt: skip


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_slot_decoder_decodes_the_same_logits_with_the_kernel(dtype: torch.dtype) -> None:
    config = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval().to(dtype)  # head size 16
    prompts = [[1, 2, 3, 4, 5], [7, 8], list(range(20, 60))]
    logits = {}
    for use in (True, False):
        decoder = SlotDecoder(model, rows=4)
        assert decoder.kernel is not None
        if not use:
            decoder.kernel = None  # SDPA with the mask
        batch, _ = SlotBatch.prefill(
            decoder, prompts, PrefixCache(0), pad_id=0, offset=0, columns=64
        )
        logits[use] = torch.stack([batch.decode(None, torch.tensor([3, 4, 5])) for _ in range(3)])
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(logits[True], logits[False], atol=tolerance, rtol=tolerance)


def test_without_a_compiler_decoding_keeps_sdpa_with_one_warning(
    fresh_build: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING):
        assert cpu_attention.kernel() is None
        assert cpu_attention.kernel() is None  # looked up once
    assert len(caplog.records) == 1
    assert "no C compiler" in caplog.records[0].getMessage()


def test_a_compiler_that_fails_leaves_sdpa_and_says_why(
    fresh_build: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", shutil.which("false") or "false")
    with caplog.at_level(logging.WARNING):
        assert cpu_attention.kernel() is None
    assert "could not be built" in caplog.text and "failed" in caplog.text


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kv_heads", "group", "dim"), [(3, 3, 64), (1, 4, 256), (2, 2, 48)],
    ids=["smollm2", "gemma3_270m", "dim_48"],
)  # fmt: skip
def test_chunks_attend_as_sdpa_each_token_within_its_span(
    kernel: cpu_attention.Kernel, dtype: torch.dtype, kv_heads: int, group: int, dim: int
) -> None:
    """Two chunks of one slot each (45 tokens: two tiles, the second partial; 3 tokens) and a
    row between them the chunk kernel leaves alone; each token attends to its own causal span
    (a sliding window of 20 for the first chunk), nothing outside it is read."""
    columns = 128
    keys, values = _cache(4, kv_heads, columns, dim, dtype)
    rows = 45 + 1 + 3
    query = torch.randn(rows, kv_heads, group, dim).to(dtype)
    slots = torch.tensor([2] * 45 + [0] + [3] * 3)
    ends = torch.cat([torch.arange(40, 85), torch.tensor([7]), torch.arange(1, 4)]) + 1
    starts = torch.cat([(ends[:45] - 20).clamp(min=0), torch.tensor([0, 0, 0, 0])])
    chunks = torch.tensor([[0, 45, 2], [46, 49, 3]])
    inside = (torch.arange(columns) >= starts[:, None]) & (torch.arange(columns) < ends[:, None])
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.double(), keys[slots].double(), values[slots].double(),
        attn_mask=inside[:, None, None], scale=dim**-0.5,
    )  # fmt: skip
    for slot in (2, 3):  # NaN where no row of the slot may read, to catch a read outside
        mine = slots == slot
        never = ~inside[mine].any(0)
        keys[slot][:, never] = float("nan")
        values[slot][:, never] = float("nan")
    out = torch.full_like(query, 7.0)
    kernel.chunks(query, keys, values, out, chunks, starts, ends, dim**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    chunked = slots != 0
    torch.testing.assert_close(
        out[chunked].double(), expected[chunked], atol=tolerance, rtol=tolerance
    )
    assert torch.equal(out[45], torch.full_like(out[45], 7.0))  # not a chunk's: untouched
