"""The running batch's KV cache for the in-process engine, and the prefix cache that spares
prefills.

`KVBatch` holds a transformers `DynamicCache` whose layers append in place (`_GrowingLayer`:
views of buffers with room to grow, where `DynamicLayer` concatenates the whole cache anew
for every token, which took half of a decoding step at 64 rows x 300 tokens on a 2-core CPU),
laid out left-padded: every row appends at
the same column, a joining batch is padded on the left to the running batch's width (or it to
the joining one's), a leaving row is cut out, and columns no row uses any more are dropped.
`mask` [B, W] marks the real tokens, which need not be contiguous (a prefix reused from the
prefix cache is followed by the padding of the new tokens); positions are per row, so padding
changes no result beyond floating-point noise.

`PrefixCache` keeps the KV of finished requests (prompt and sampled tokens), most recently used
first, within a token budget. A new request that starts with tokens of an entry reuses their KV
and prefills only the rest: a trajectory's next turn (its context plus the tool response) and
the samples of one prompt cost what is new in them. Requests with the same prompt in one
prefill are computed once. New weights make every entry stale: `clear()`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from codeloop.engine.protocol import SamplingParams
from codeloop.engine.sampler import sample

Forward = Callable[..., torch.Tensor]  # (cache, **inputs) -> last-position logits [B, V]


@dataclass
class CachedPrefix:
    ids: tuple[int, ...]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [heads, len, head_dim]


class PrefixCache:
    """See the module docstring. `max_tokens` 0 disables it.

    Entries are indexed by chained hashes of their whole blocks of `BLOCK` tokens, so that a
    lookup compares a prompt with the few entries that share its deepest block rather than
    with every entry (a scan of 512 entries of ~1,000 tokens took tens of milliseconds a
    lookup); the hashes only choose candidates, whose common prefix is then counted exactly."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.reused_tokens = 0  # prompt tokens not prefilled thanks to an entry
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()
        # chain hash of a block -> the entries holding the blocks up to it; and the entries
        # whose last whole block it is (None: entries shorter than a block)
        self._holding: dict[int, set[tuple[int, ...]]] = {}
        self._ending: dict[int | None, set[tuple[int, ...]]] = {}

    def lookup(self, prompt: Sequence[int]) -> tuple[int, CachedPrefix | None]:
        """The longest reusable prefix of `prompt` (at most all but its last token, whose
        logits are needed) and the entry that holds it."""
        prompt = tuple(prompt)
        best, found, limit = 0, None, len(prompt) - 1
        for ids in self._candidates(prompt[:limit]):
            n = _common_prefix(ids, prompt, min(limit, len(ids)))
            if n > best:
                best, found = n, self._entries[ids]
        if found is not None:
            self._entries.move_to_end(found.ids)
            self.reused_tokens += best
        return best, found

    def peek(self, ids: tuple[int, ...]) -> int:
        """How many of `ids` an entry holds (a lookup that changes nothing)."""
        return max(
            (_common_prefix(e, ids, min(len(ids), len(e))) for e in self._candidates(ids)),
            default=0,
        )

    def _candidates(self, ids: tuple[int, ...]) -> set[tuple[int, ...]]:
        """Entries among which the longest common prefix with `ids` is: those holding the
        deepest block of `ids` that any entry holds, or, when none holds its first block, the
        entries shorter than a block and those starting with its first token."""
        deepest = None
        for chain in _chain(ids):
            if chain not in self._holding:
                break
            deepest = chain
        if deepest is not None:
            return self._holding[deepest]
        return {e for e in self._entries if e[:1] == ids[:1]} if ids else set()

    def store(self, ids: tuple[int, ...], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not self.max_tokens or len(ids) > self.max_tokens:
            return
        chains = _chain(ids)
        for key in self._prefixes_of(ids, chains):
            self._remove(key)
        if ids in self._entries:
            self._remove(ids)
        self._entries[ids] = CachedPrefix(ids, kv)
        self.tokens += len(ids)
        for chain in chains:
            self._holding.setdefault(chain, set()).add(ids)
        self._ending.setdefault(chains[-1] if chains else None, set()).add(ids)
        while self.tokens > self.max_tokens:
            self._remove(next(iter(self._entries)))

    def _prefixes_of(self, ids: tuple[int, ...], chains: list[int]) -> list[tuple[int, ...]]:
        """The entries that are prefixes of `ids` (a new entry supersedes them)."""
        ends = [None, *chains]
        return [
            key
            for end in ends
            for key in self._ending.get(end, ())
            if len(key) <= len(ids) and ids[: len(key)] == key
        ]

    def _remove(self, ids: tuple[int, ...]) -> None:
        self.tokens -= len(self._entries.pop(ids).ids)
        chains = _chain(ids)
        for chain in chains:
            holders = self._holding[chain]
            holders.discard(ids)
            if not holders:
                del self._holding[chain]
        end = chains[-1] if chains else None
        self._ending[end].discard(ids)
        if not self._ending[end]:
            del self._ending[end]

    def clear(self) -> None:
        self._entries.clear()
        self._holding.clear()
        self._ending.clear()
        self.tokens = 0


BLOCK = 16  # tokens per hashed block of the prefix cache's index


def _chain(ids: tuple[int, ...]) -> list[int]:
    """Chained hashes of the whole blocks of `ids`: the k-th stands for ids[: (k + 1) * BLOCK]."""
    chains, chain = [], 0
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        chain = hash((chain, ids[start : start + BLOCK]))
        chains.append(chain)
    return chains


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...], limit: int) -> int:
    """The length of the common prefix of a and b, at most `limit` (binary search over slice
    comparisons, which run in C)."""
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class KVBatch:
    """See the module docstring; `lengths` [B] counts each row's real tokens (its next
    position)."""

    def __init__(self, cache: DynamicCache, mask: torch.Tensor, lengths: torch.Tensor) -> None:
        self.cache, self.mask, self.lengths = cache, mask, lengths

    @classmethod
    def prefill(
        cls,
        forward: Forward,
        prompts: list[list[int]],
        prefixes: PrefixCache,
        *,
        pad_id: int,
        device: torch.device,
    ) -> tuple[KVBatch, torch.Tensor]:
        """A batch of the prompts, each prefilled past its cached prefix (identical prompts
        once), and the next-token logits [B, V]."""
        unique = list(dict.fromkeys(tuple(p) for p in prompts))
        _share_common_prefix(forward, unique, prefixes, device)
        found = [prefixes.lookup(p) for p in unique]
        reused = max(n for n, _ in found)  # columns of cached KV
        width = max(len(p) - n for p, (n, _) in zip(unique, found, strict=True))  # new columns
        ids = torch.full((len(unique), width), pad_id, dtype=torch.long)  # [U, S]
        mask = torch.zeros((len(unique), reused + width), dtype=torch.long)  # [U, C + S]
        positions = torch.zeros((len(unique), width), dtype=torch.long)  # [U, S]
        for row, (prompt, (n, _)) in enumerate(zip(unique, found, strict=True)):
            new = len(prompt) - n
            ids[row, width - new :] = torch.tensor(prompt[n:])
            mask[row, reused - n : reused] = 1
            mask[row, reused + width - new :] = 1
            positions[row, width - new :] = torch.arange(n, len(prompt))
        cache = _cache_of(found, reused, device)
        mask = mask.to(device)
        logits = forward(
            cache, input_ids=ids.to(device), attention_mask=mask, position_ids=positions.to(device)
        )
        batch = cls(cache, mask, mask.sum(-1))
        if len(unique) < len(prompts):
            row_of = {p: i for i, p in enumerate(unique)}
            index = [row_of[tuple(p)] for p in prompts]
            batch.select(index)
            logits = logits[torch.tensor(index, device=logits.device)]
        return batch, logits

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], draws: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A token and its logprob for each row (`sampler.sample`)."""
        return sample(logits, params, draws)

    def decode(self, forward: Forward, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([B]); the next-token logits [B, V]."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=-1)
        logits = forward(
            self.cache,
            input_ids=tokens.unsqueeze(-1),
            attention_mask=self.mask,
            position_ids=self.lengths.unsqueeze(-1),
        )
        self.lengths = self.lengths + 1
        return logits

    def row_kv(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of one row's KV, its real tokens only: per layer [heads, len, head_dim]."""
        # the columns found once: a boolean index per layer stopped a GPU 2 x layers times
        real = self.mask[row].nonzero().squeeze(-1)
        return [
            (layer.keys[row].index_select(1, real), layer.values[row].index_select(1, real))
            for layer in _layers(self.cache)
        ]

    def select(self, rows: list[int]) -> list[int]:
        """Keep these rows (in this order; one may repeat), and drop the columns none uses;
        returns `rows` (the kept rows in their new order). Rows kept in their order (requests
        leaving) move up inside the layers' buffers; only the rows after the first one left are
        copied, and dropped columns are not copied."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.mask, self.lengths = self.mask[index], self.lengths[index]
        used = self.mask.any(0)
        drop = int(used.long().argmax()) if bool(used.any()) else 0
        in_order = all(b > a for a, b in zip(rows, rows[1:], strict=False))
        for layer in _layers(self.cache):
            if not (in_order and layer.compact(rows, drop)):
                _replace(layer, layer.keys[index, :, drop:], layer.values[index, :, drop:])
        self.mask = self.mask[:, drop:]
        return rows

    def merge(self, other: KVBatch) -> KVBatch:
        """This batch's rows, then `other`'s, padded on the left to one width. The joining
        rows are written into the spare rows of this batch's buffers where they fit."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(_layers(self.cache), _layers(other.cache), strict=True):
            if not mine.append_rows(theirs.keys, theirs.values):
                keys = torch.cat([_pad_left(mine.keys, width), _pad_left(theirs.keys, width)])
                values = torch.cat([_pad_left(mine.values, width), _pad_left(theirs.values, width)])
                _replace(mine, keys, values)
        self.mask = torch.cat([_pad_left(self.mask, width, -1), _pad_left(other.mask, width, -1)])
        self.lengths = torch.cat([self.lengths, other.lengths])
        return self


SHARED_PREFIX_MIN = 32  # tokens: a shorter common prefix is not worth a forward pass of its own


def _share_common_prefix(
    forward: Forward, prompts: list[tuple[int, ...]], prefixes: PrefixCache, device: torch.device
) -> None:
    """Prefill the prompts' common prefix (a system prompt, say) once and cache it, when
    several prompts share at least `SHARED_PREFIX_MIN` tokens that are not cached yet."""
    if len(prompts) < 2 or not prefixes.max_tokens:
        return
    shortest = min(len(p) for p in prompts) - 1
    common = min(_common_prefix(prompts[0], p, shortest) for p in prompts[1:])
    if common - prefixes.peek(prompts[0][:common]) < SHARED_PREFIX_MIN:
        return
    head = list(prompts[0][:common])
    batch, _ = KVBatch.prefill(
        forward, [head + [0]], prefixes, pad_id=0, device=device
    )  # one spare token
    prefixes.store(tuple(head), [(k[:, :common], v[:, :common]) for k, v in batch.row_kv(0)])


def _cache_of(
    found: list[tuple[int, CachedPrefix | None]], width: int, device: torch.device
) -> DynamicCache:
    """A cache of the reused prefixes, each left-padded to `width` columns ([U, heads, width,
    head_dim] per layer); empty when nothing is reused."""
    cache = new_cache()
    if width == 0:
        return cache
    template = next(entry for n, entry in found if entry is not None and n).kv
    for layer, (keys, _) in enumerate(template):
        heads, _, dim = keys.shape
        stacked = []
        for tensor_index in (0, 1):
            rows = []
            for n, entry in found:
                part = (
                    entry.kv[layer][tensor_index][:, :n]
                    if entry is not None and n
                    else keys.new_zeros((heads, 0, dim))
                )
                rows.append(_pad_left(part, width))
            stacked.append(torch.stack(rows).to(device))
        cache.update(stacked[0], stacked[1], layer)
    return cache


class _GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that appends in place: `keys` / `values` are views of buffers
    [rows, heads, columns, head_dim] with room to spare: a quarter more columns (at least 64)
    and a quarter more rows (at least 4), the view starting at column `_start`. Rows leave by
    moving the later rows up (`compact`), join by filling spare rows (`append_rows`); when
    something else replaced `keys` (or the room ran out), the next update copies them into new
    buffers once."""

    _keys_buffer: torch.Tensor | None = None
    _values_buffer: torch.Tensor | None = None
    _start = 0

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The buffers, while `keys` is still the view this layer made of them."""
        if self._keys_buffer is None or self._values_buffer is None:
            return None
        if getattr(self, "_view", None) is not self.keys:
            return None
        return self._keys_buffer, self._values_buffer

    def _set_view(self, rows: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._keys_buffer is not None and self._values_buffer is not None
        keys = self._keys_buffer[:rows, :, start:end]
        values = self._values_buffer[:rows, :, start:end]
        self.keys, self.values, self._start, self._view = keys, values, start, keys
        return keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old_keys, old_values = self.keys, self.values
        assert old_keys is not None and old_values is not None
        length = old_keys.shape[-2] if old_keys.dim() == 4 else 0
        rows, end = key_states.shape[0], length + key_states.shape[-2]
        buffers = self._buffers() if length else None
        if buffers is None or self._start + end > buffers[0].shape[-2]:  # new buffers
            if not length:
                old_keys, old_values = key_states[:, :, :0], value_states[:, :, :0]
            buffers = self._rebuffer(old_keys, old_values, end)
        start = self._start
        buffers[0][:rows, :, start + length : start + end] = key_states
        buffers[1][:rows, :, start + length : start + end] = value_states
        return self._set_view(rows, start, start + end)

    def _rebuffer(
        self, keys: torch.Tensor, values: torch.Tensor, columns: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """New buffers holding `keys` / `values` from column 0, with room for `columns` and
        more."""
        rows, length = keys.shape[0], keys.shape[-2]
        shape = (
            rows + max(4, rows // 4),
            keys.shape[1],
            columns + max(64, columns // 4),
            keys.shape[-1],
        )
        buffers = keys.new_empty(shape), values.new_empty(shape)
        buffers[0][:rows, :, :length] = keys
        buffers[1][:rows, :, :length] = values
        self._keys_buffer, self._values_buffer = buffers
        self._set_view(rows, 0, length)
        return buffers

    def compact(self, rows: list[int], drop: int) -> bool:
        """Keep `rows` (increasing) and drop the first `drop` columns, inside the buffers;
        False when the keys are not a view of them."""
        buffers = self._buffers()
        if buffers is None:
            return False
        start, end = self._start + drop, self._start + self._width()
        first = next((i for i, row in enumerate(rows) if row != i), len(rows))
        if first < len(rows):  # rows first.. move up; the source is gathered before writing
            source = torch.tensor(rows[first:], device=buffers[0].device)
            for buffer in buffers:
                buffer[first : len(rows), :, start:end] = buffer[source, :, start:end]
        self._set_view(len(rows), start, end)
        return True

    def append_rows(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Add rows after this layer's, left-padded with zeros to its width, in the buffers'
        spare rows; False when they do not fit (too many rows, or wider than the columns
        left of the view's end)."""
        buffers = self._buffers()
        if buffers is None:
            return False
        rows, length = self._rows(), self._width()
        joining, width = keys.shape[0], keys.shape[-2]
        start, end = self._start, self._start + length
        if rows + joining > buffers[0].shape[0] or width > end:
            return False
        if width > length:  # wider: the view grows to the left, the old rows padded
            start = end - width
            for buffer in buffers:
                buffer[:rows, :, start : end - length] = 0
        for buffer, new in zip(buffers, (keys, values), strict=True):
            buffer[rows : rows + joining, :, start : end - width] = 0
            buffer[rows : rows + joining, :, end - width : end] = new
        self._set_view(rows + joining, start, end)
        return True

    def _rows(self) -> int:
        assert self.keys is not None
        return int(self.keys.shape[0])

    def _width(self) -> int:
        assert self.keys is not None
        return int(self.keys.shape[-2])


def _replace(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
    """New keys and values for a layer, whose spare-room buffers (if any) are let go at once
    rather than held until its next update."""
    layer.keys, layer.values = keys, values
    layer._keys_buffer = layer._values_buffer = None


def new_cache() -> DynamicCache:
    """An empty `DynamicCache` of growing layers."""
    cache = DynamicCache()  # its layers are created on first use, of this class:
    cache.layer_class_to_replicate = _GrowingLayer
    return cache


def _layers(cache: DynamicCache) -> list[Any]:
    """The cache's per-layer `keys` / `values` tensors [B, heads, W, head_dim]."""
    return list(cache.layers)


def _pad_left(tensor: torch.Tensor, width: int, dim: int = -2) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
