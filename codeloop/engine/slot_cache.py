"""A KV cache of fixed slots and a decoding step of static shapes, for the in-process engine.

transformers' forward, driven from Python one decoding step at a time, is a few hundred kernel
launches a step: on a GPU the host sets the pace and the card waits (SmolLM2-135M decoded about
400 tokens/s on an H200 that way). This module runs the model's own layers over a cache
allocated once, so that a decoding step has the same shapes and addresses every time and can be
captured as a CUDA graph and replayed in one launch:

- `SlotDecoder` holds the cache, one tensor [layers, 2 (keys, values), rows, KV heads, columns,
  head size]; row r of a batch lives in slot r. A token at position p is written to column p of
  its slot and attends to the columns 0..p of it, so no slot needs a length of its own: what
  lies beyond a row's tokens (another request's leftovers, a padded prefill's writes) weighs
  nothing until the row writes it (the cache is zeroed when made, and what it holds after is
  the model's own finite output). Columns grow (doubling, from `MIN_COLUMNS`) when a request
  needs more; the graphs are captured again after.
- The forward uses the model's own modules and weights (embedding, norms, output projection,
  MLP down projection, output layer) and its rotary tables, with fewer operations a layer: q, k
  and v in one matrix product, gate and up in another (merged copies of their weights, which
  `refresh` updates in place after `update_weights`: the replayed graphs read them; they take
  as much memory again as those projections), RMSNorm as `torch.nn.functional.rms_norm`,
  rotary as a roll with the sign folded into the sine table (the same values as transformers'
  `apply_rotary_pos_emb`), and the attention mask made once a step for every layer.
  Attention packs the query heads of each KV head together ([rows, KV heads, group x queries,
  head size]) and calls SDPA with a mask (`column <= position`), reading the first `width`
  columns: the smallest power of two (at least `MIN_WIDTH`) past every row's position.
- On a CPU a decoding step runs eagerly, its attention by the C kernel of `cpu_attention.py`
  where it builds (`cpu_kernel`): each row reads its own columns 0..p, so no mask is made; the
  cache is an anonymous memory map, so slots and columns never written take no memory. Its
  matrix products use weights packed once for oneDNN where torch can (`cpu_linear.py`):
  copies made from the model's weights (no merged copy is kept beside them), packed again by
  `refresh`.
- On CUDA a decoding step of `b` rows and `width` columns is captured once, lazily, for `b` on a
  ladder (1, 2, 4, 8, then multiples of 16) and replayed for any batch up to `b` (the extra rows
  decode a token 0 at position 0 in free slots). Prefill runs eagerly, right-padded, in chunks
  whose attention scores stay under `PREFILL_SCORES` elements; a row may instead take the rest
  of its prompt through the decoding steps, a token a step (`SlotBatch.feed`).
- `SlotBatch` is `KVBatch`'s counterpart for the engine: rows, their lengths, the prefix cache's
  copies, and rows leaving (the last rows move into the holes, one copy each).

Supported: decoder-only models of the Llama family (`llama`, `mistral` without a sliding
window, `qwen2`, `qwen3`) and Gemma 3's text models (`gemma3_text`: local layers that attend to
the last `sliding_window` positions, with a mask and rotary tables of their own, (1 + w)
RMSNorms after attention and the MLP too, the final logits soft-capped where the config says;
not soft-capped attention logits, which SDPA cannot apply), whose rotary embedding does not
change with the sequence's length;
`unsupported_reason` says why another model is not, and the engine then keeps its
`DynamicCache` path.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from codeloop.engine import cpu_attention, cpu_linear
from codeloop.engine.kv_batch import SHARED_PREFIX_MIN, PrefixCache, _common_prefix
from codeloop.engine.protocol import SamplingParams
from codeloop.engine.sampler import sample
from codeloop.errors import RunError
from codeloop.memory import free_memory

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
MIN_COLUMNS = 1024  # a slot's first size (tokens); doubles when a request needs more
MIN_WIDTH = 128  # the fewest columns a decoding step reads
# A prompt's chunk of at least this many tokens in a step is attended on a CPU by the chunk
# kernel (its keys read once for all of them) rather than by the decoding kernel a token at a time
CHUNK_MIN = 4
PREFILL_SCORES = 2**26  # attention-score elements of one prefill chunk (rows x heads x q x k)


def _size(count: int) -> str:
    """Bytes in the largest binary unit that leaves at least 1 of it."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


def unsupported_reason(model: Any) -> str | None:
    """Why `model` cannot run on slots, or None when it can."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"model type {kind!r} is not one of {', '.join(FAMILIES)}"
    if getattr(config, "use_sliding_window", False) or (
        kind == "mistral" and getattr(config, "sliding_window", None)
    ):
        return "sliding-window attention"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention logits soft-capped"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        return "no rotary embedding module"
    kinds = getattr(rotary, "rope_type", "default")
    for rope in kinds.values() if isinstance(kinds, dict) else [kinds]:
        if rope in ("dynamic", "longrope"):
            return f"rotary embedding {rope!r} depends on the sequence's length"
    return None


def cpu_kernel(model: Any) -> cpu_attention.Kernel | None:
    """The CPU attention kernel for `model`'s decoding steps: None unless the model is on the
    CPU, runs on slots (`unsupported_reason`), the kernel builds, and it takes the model's
    dtype and heads."""
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or unsupported_reason(model):
        return None
    config = model.config
    heads = int(config.num_attention_heads)
    group = heads // int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(model.model.layers[0].self_attn.head_dim)
    kernel = cpu_attention.kernel()
    return kernel if kernel and kernel.handles(parameter.dtype, head_dim, group) else None


def ladder(rows: int) -> list[int]:
    """The batch sizes a decoding step is captured for: 1, 2, 4, 8, then multiples of 16, and
    `rows`."""
    sizes = [b for b in (1, 2, 4, 8) if b < rows] + list(range(16, rows, 16))
    return [*sizes, rows]


class SlotDecoder:
    """The model's forward over a slot cache of `rows` slots; see the module docstring."""

    def __init__(
        self,
        model: Any,
        rows: int,
        graphs: bool | None = None,
        *,
        compile_backend: str = "",
        pack: bool | None = None,
    ) -> None:
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"the slot cache cannot run this model: {reason}")
        config, inner = model.config, model.model
        self.model, self.rows = model, rows
        self.layers = list(inner.layers)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(self.layers[0].self_attn.head_dim)
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.graphs_on = self.device.type == "cuda" if graphs is None else graphs
        # Gemma 3: (1 + w) RMSNorms, norms after attention and the MLP too, local layers that
        # see the last `window` positions with rotary tables of their own
        self.gemma = config.model_type == "gemma3_text"
        self.layer_types = list(getattr(config, "layer_types", None) or [])
        if not self.gemma or len(self.layer_types) != len(self.layers):
            self.layer_types = ["full_attention"] * len(self.layers)
        self.window = int(getattr(config, "sliding_window", None) or 0)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.columns = 0
        self.kv = torch.empty(0, device=self.device, dtype=self.dtype)
        # the rotary tables of each layer type: cos and signed sin, each [columns, head_dim]
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # a decoding step's inputs, where the captured graphs read them
        self.tokens = torch.zeros(rows, dtype=torch.long, device=self.device)  # [rows]
        self.positions = torch.zeros(rows, dtype=torch.long, device=self.device)  # [rows]
        self.slots = torch.arange(rows, device=self.device)  # [rows]
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.captures = 0  # graphs captured since made (growth drops the held ones)
        self._pool: Any = None
        self.ladder = ladder(rows)
        # on a CPU, eager steps multiply by weights packed once for oneDNN (`cpu_linear`):
        # copies, packed again by `refresh` when new weights arrive (None: where it can)
        eager_cpu = self.device.type == "cpu" and not compile_backend
        can_pack = eager_cpu and cpu_linear.packs(self.dtype)
        self.packed = can_pack if pack is None else pack and can_pack
        # q, k and v merged into one matrix a layer, gate and up into another: two matrix
        # products instead of five. Copies of the model's weights, refreshed in place
        # (`refresh`) when new weights arrive, since the captured graphs read them (packed
        # weights are made from the model's own, with no merged copy kept beside them).
        self.qkv = [] if self.packed else [self._qkv_weight(layer) for layer in self.layers]
        self.qkv_bias = [self._qkv_bias(layer) for layer in self.layers]
        self.gate_up = [] if self.packed else [self._gate_up_weight(layer) for layer in self.layers]
        attn, act = self.layers[0].self_attn, self.layers[0].mlp.act_fn
        qk_norm = hasattr(attn, "q_norm")
        self.spec = _Spec(
            self.heads, self.kv_heads, self.head_dim, self.gemma, qk_norm, float(attn.scaling), act,
            self.packed,
        )  # fmt: skip
        self.head: torch.Tensor | None = None  # the output layer's packed weight
        # each layer's tensors, in `_layer`'s order (the merged ones are the copies above)
        self.weights: list[_Weights] = []
        self._take_weights()
        # the decoding step's layers compiled with `compile_backend` (`torch.compile`: one
        # program for every layer, as they differ only in their tensors), or None: eager
        self._compiled: Any = (
            torch.compile(_layer, backend=compile_backend, dynamic=True, fullgraph=True)
            if compile_backend
            else None
        )
        # on a CPU, eager decoding steps attend through the C kernel (cpu_attention.py) where
        # it builds: each row reads its own columns, with no mask
        self.kernel = None if compile_backend else cpu_kernel(model)
        self.ensure_columns(MIN_COLUMNS)

    def _take_weights(self) -> None:
        """Each layer's tensors for `_layer` (packed copies, where packed) and the output
        layer's packed weight."""
        self.weights = [self._layer_weights(index) for index in range(len(self.layers))]
        if self.packed:
            self.head = cpu_linear.pack(self.model.lm_head.weight)

    def _layer_weights(self, index: int) -> _Weights:
        layer = self.layers[index]
        attn, mlp = layer.self_attn, layer.mlp

        def norm(module: Any) -> tuple[torch.Tensor, float]:
            eps = getattr(module, "variance_epsilon", None)
            return module.weight, float(module.eps if eps is None else eps)

        q_norm, k_norm = (
            (norm(attn.q_norm), norm(attn.k_norm)) if self.spec.qk_norm else (None, None)
        )
        gemma = self.gemma
        if self.packed:
            qkv = cpu_linear.pack(self._qkv_weight(layer))
            o_proj = cpu_linear.pack(attn.o_proj.weight)
            gate_up = cpu_linear.pack(self._gate_up_weight(layer))
            down = cpu_linear.pack(mlp.down_proj.weight)
        else:
            qkv, o_proj = self.qkv[index], attn.o_proj.weight
            gate_up, down = self.gate_up[index], mlp.down_proj.weight
        return _Weights(
            norm(layer.input_layernorm),
            qkv,
            self.qkv_bias[index],
            q_norm,
            k_norm,
            o_proj,
            attn.o_proj.bias,
            norm(layer.post_attention_layernorm),
            norm(layer.pre_feedforward_layernorm) if gemma else None,
            gate_up,
            down,
            mlp.down_proj.bias,
            norm(layer.post_feedforward_layernorm) if gemma else None,
        )

    @staticmethod
    def _qkv_weight(layer: Any) -> torch.Tensor:
        attn = layer.self_attn
        return torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()

    @staticmethod
    def _qkv_bias(layer: Any) -> torch.Tensor | None:
        attn = layer.self_attn
        if attn.q_proj.bias is None:
            return None
        return torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach()

    @staticmethod
    def _gate_up_weight(layer: Any) -> torch.Tensor:
        return torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]).detach()

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the model's current weights into the merged projections, in place (packed
        weights: pack them again)."""
        for index, layer in enumerate(self.layers):
            bias = self.qkv_bias[index]
            if bias is not None:
                bias.copy_(self._qkv_bias(layer))  # type: ignore[arg-type]
            if not self.packed:
                self.qkv[index].copy_(self._qkv_weight(layer))
                self.gate_up[index].copy_(self._gate_up_weight(layer))
        if self.packed:
            self._take_weights()

    def ensure_columns(self, needed: int) -> None:
        """Room for positions 0..needed-1 in every slot (the cache grows by doubling; the
        captured graphs are dropped, as they read the old cache). Refused with a `RunError`
        naming the sizes when the new cache would not fit in the memory free now."""
        if needed <= self.columns:
            return
        columns = max(self.columns, MIN_COLUMNS)
        while columns < needed:
            columns *= 2
        shape = (len(self.layers), 2, self.rows, self.kv_heads, columns, self.head_dim)
        self._check_fits(shape, needed)
        kv = _zeros(shape, self.dtype, self.device)
        if self.columns:
            kv[..., : self.columns, :] = self.kv
        self.kv, self.columns = kv, columns
        positions = torch.arange(columns, device=self.device).unsqueeze(0)  # [1, columns]
        probe = torch.empty(1, device=self.device, dtype=self.dtype)
        for layer_type in set(self.layer_types):
            cos, sin = self._rotary_tables(probe, positions, layer_type)  # [1, columns, D]
            # sin with rotate_half's sign folded in: rotate_half(x) * sin == roll(x) * signed
            half = sin.shape[-1] // 2
            signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
            self.tables[layer_type] = (cos[0], signed)
        # the old graphs go with their memory pool: a pool whose graphs are all freed cannot
        # take new captures (the caching allocator asserts `use_count > 0`)
        self._graphs.clear()
        self._pool = None

    def _rotary_tables(
        self, probe: torch.Tensor, positions: torch.Tensor, layer_type: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [1, columns, head_dim] of the model's rotary embedding for a layer type:
        Gemma 3's embedding takes the type (transformers 5), or has a module of its own for the
        local layers (`rotary_emb_local`, transformers 4); the others have one for all."""
        inner = self.model.model
        if not self.gemma:
            tables: tuple[torch.Tensor, torch.Tensor] = inner.rotary_emb(probe, positions)
        elif hasattr(inner, "rotary_emb_local"):
            local = layer_type == "sliding_attention"
            tables = (inner.rotary_emb_local if local else inner.rotary_emb)(probe, positions)
        else:
            tables = inner.rotary_emb(probe, positions, layer_type)
        return tables

    def _check_fits(self, shape: tuple[int, ...], needed: int) -> None:
        per_token = shape[0] * shape[1] * shape[3] * shape[5] * self.kv.element_size()
        wanted = per_token * shape[2] * shape[4]
        free = free_memory(self.device)
        if wanted > free:
            where = "the GPU" if self.device.type == "cuda" else "the machine"
            raise RunError(
                f"the engine's KV slots for {needed:,} tokens need {_size(wanted)} "
                f"({shape[2]} rows x {shape[4]:,} tokens x {_size(per_token)} a token) and "
                f"{where} has {_size(free)} free: lower rollout.engine_max_batch or the token "
                "budgets (rollout.max_response_tokens)"
            )

    def width(self, longest: int) -> int:
        """The columns a step reads when its rows hold at most `longest` tokens (this step's
        included)."""
        width = MIN_WIDTH
        while width < longest:
            width *= 2
        return min(width, self.columns)

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor | None,
        width: int,
        *,
        last: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        chunks: Sequence[tuple[int, int]] = (),
    ) -> torch.Tensor:
        """Feed `tokens` [n, T] at `positions` [n, T] into `slots` [n] (None: the first n,
        read in place rather than gathered) and return the logits [n, V] (float32) at each
        row's query `last` [n] (default the last one), or only at those of `rows` [m] ([m, V]).
        Each row's KV is written to its slot; every query attends to its slot's columns up to
        its position (within the first `width`). Several rows may share a slot (one token a
        row, the tokens of a prompt's chunk): each sees the others' columns below its own."""
        n, t = tokens.shape
        read: slice | torch.Tensor = slice(0, n) if slots is None else slots
        slots = self.slots[:n] if slots is None else slots
        group = self.heads // self.kv_heads
        x = self.model.model.embed_tokens(tokens)  # [n, T, hidden] (Gemma's scaled in it)
        tables = {
            kind: (cos[positions], sin[positions]) for kind, (cos, sin) in self.tables.items()
        }
        in_place = t == 1 and isinstance(read, slice)  # a decoding step, slots in place
        masks = (
            self._spans(positions[:, 0], None if in_place else slots, chunks)
            if t == 1 and self.kernel is not None
            else self._masks(positions, width, group)
        )  # made once for every layer
        where = slots.unsqueeze(1).expand(n, t)  # [n, T]
        # the compiled layers serve decoding steps (one token a row, slots in place)
        compiled = self._compiled is not None and in_place
        step = self._compiled if compiled else _layer
        for index, weights in enumerate(self.weights):
            kind = self.layer_types[index]
            cos, sin = tables[kind]
            keys, values = self.kv[index, 0], self.kv[index, 1]  # [rows, KVH, columns, D]
            x = step(
                x, weights, self.spec, cos, sin, masks[kind], keys, values, where, positions,
                read, width,
            )  # fmt: skip
        picked = torch.arange(n, device=tokens.device) if rows is None else rows
        queries = last[picked] if last is not None else torch.full_like(picked, t - 1)
        x = self._norm(self.model.model.norm, x[picked, queries])  # [m, hidden]
        head = self.model.lm_head
        logits = head(x) if self.head is None else cpu_linear.linear(x, self.head, head.bias)
        if self.softcap:  # Gemma's final soft-capping, in the model's dtype as transformers'
            logits = torch.tanh(logits / self.softcap) * self.softcap
        scores: torch.Tensor = logits.float()
        return scores

    def step(
        self, tokens: list[int], slots: list[int], positions: list[int], out: list[int]
    ) -> torch.Tensor:
        """One forward of tokens in any slots: token i goes into slot `slots[i]` at
        `positions[i]` (a decoding row's next token, or a prompt's chunk: several tokens of one
        slot at consecutive positions, each attending to the columns up to its own); the logits
        [len(out), V] after the tokens at the indices `out`."""
        chunks, first = [], 0
        for i in range(1, len(slots) + 1):
            if i == len(slots) or slots[i] != slots[first]:
                if i - first >= CHUNK_MIN:
                    chunks.append((first, i - first))
                first = i
        column = torch.tensor(tokens, dtype=torch.long).unsqueeze(1).to(self.device)  # [N, 1]
        at = torch.tensor(positions, dtype=torch.long).unsqueeze(1).to(self.device)  # [N, 1]
        return self.forward(
            column,
            at,
            torch.tensor(slots, dtype=torch.long).to(self.device),
            self.width(max(positions) + 1),
            rows=torch.tensor(out, dtype=torch.long).to(self.device),
            chunks=chunks,
        )

    def _masks(self, positions: torch.Tensor, width: int, group: int) -> dict[str, torch.Tensor]:
        """Each layer type's additive mask for queries at `positions` [n, T] over `width`
        columns: every column up to the query's position; for sliding layers, the last
        `window` of them."""
        columns = torch.arange(width, device=positions.device)
        attend = columns <= positions.unsqueeze(-1)  # [n, T, width]
        masks = {"full_attention": self._mask(attend, group)}
        if "sliding_attention" in self.tables:
            recent = columns > positions.unsqueeze(-1) - self.window
            masks["sliding_attention"] = self._mask(attend & recent, group)
        return masks

    def _spans(
        self,
        positions: torch.Tensor,
        slots: torch.Tensor | None,
        chunks: Sequence[tuple[int, int]] = (),
    ) -> dict[str, _Spans]:
        """The kernels' column spans for one query a row at `positions` [n] of `slots` [n]
        (None: row i's slot is i), as `_masks`; the rows of `chunks` (first row, count: tokens
        of one slot at consecutive positions) for the chunk kernel."""
        assert self.kernel is not None
        ends = positions + 1
        kinds = {"full_attention": torch.zeros_like(ends)}
        if "sliding_attention" in self.tables:
            kinds["sliding_attention"] = (ends - self.window).clamp(min=0)
        if not chunks:
            return {kind: _Spans(self.kernel, s, ends, slots) for kind, s in kinds.items()}
        assert slots is not None
        alone = torch.ones(len(positions), dtype=torch.bool)
        for first, count in chunks:
            alone[first : first + count] = False
        index = alone.nonzero().squeeze(1)
        table = torch.tensor(
            [(first, first + count, int(slots[first])) for first, count in chunks],
            dtype=torch.long,
        )  # [c, 3]
        return {
            kind: _Spans(self.kernel, s, ends, slots, index, table) for kind, s in kinds.items()
        }

    def _mask(self, attend: torch.Tensor, group: int) -> torch.Tensor:
        """The additive mask [n, 1, group x T, width] of `attend` [n, T, width] (a boolean one
        is converted in each layer)."""
        n, t, width = attend.shape
        blocked = torch.zeros(attend.shape, dtype=self.dtype, device=attend.device)
        blocked.masked_fill_(~attend, float("-inf"))
        return blocked[:, None, None].expand(n, 1, group, t, width).reshape(n, 1, group * t, width)

    def _norm(self, norm: Any, x: torch.Tensor) -> torch.Tensor:
        """`norm` (an RMSNorm module) of `x`, as `_normed`."""
        eps = getattr(norm, "variance_epsilon", None)
        return _normed(x, (norm.weight, float(norm.eps if eps is None else eps)), self.gemma)

    def decode(self, tokens: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """One token for each of the first n slots ([n] tokens at these positions); the
        next-token logits [n, V]. On CUDA a captured graph's replay."""
        n = len(positions)
        width = self.width(max(positions) + 1)
        where = torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)
        if not self.graphs_on:
            return self.forward(tokens.unsqueeze(1), where.unsqueeze(1), None, width)
        b = next(size for size in self.ladder if size >= n)
        self.tokens[:n].copy_(tokens)
        self.positions[:n].copy_(where)
        self.tokens[n:b].zero_()
        self.positions[n:b].zero_()
        graph, out = self._graph(b, width)
        graph.replay()
        return out[:n]

    def _graph(self, rows: int, width: int) -> tuple[Any, torch.Tensor]:
        """The captured decoding step of `rows` slots reading `width` columns."""
        key = (rows, width)
        if key not in self._graphs:
            args = (self.tokens[:rows, None], self.positions[:rows, None], None)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # a first run picks kernels and makes workspaces
                self.forward(*args, width)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self.forward(*args, width)
            self._graphs[key] = (graph, out)
            self.captures += 1
        return self._graphs[key]

    def prefill(
        self, prompts: Sequence[Sequence[int]], slots: list[int], cached: list[int], pad_id: int
    ) -> torch.Tensor:
        """Feed each prompt past its first `cached` tokens (already in its slot) into its slot;
        the logits [n, V] after each prompt's last token. Chunked so that a chunk's attention
        scores stay under `PREFILL_SCORES` elements."""
        logits: list[torch.Tensor] = []
        start = 0
        while start < len(prompts):
            end = start + 1
            while end < len(prompts) and self._scores(prompts[start : end + 1]) <= PREFILL_SCORES:
                end += 1
            logits.append(
                self._prefill_chunk(prompts[start:end], slots[start:end], cached[start:end], pad_id)
            )
            start = end
        return torch.cat(logits)

    def _scores(self, prompts: Sequence[Sequence[int]]) -> int:
        longest = max(len(p) for p in prompts)
        return len(prompts) * self.heads * longest * self.width(longest)

    def _prefill_chunk(
        self, prompts: Sequence[Sequence[int]], slots: list[int], cached: list[int], pad_id: int
    ) -> torch.Tensor:
        new = [len(p) - c for p, c in zip(prompts, cached, strict=True)]
        t = max(new)
        tokens = torch.full((len(prompts), t), pad_id, dtype=torch.long)  # [n, T] right-padded
        positions = torch.empty((len(prompts), t), dtype=torch.long)  # [n, T]
        for row, (prompt, c) in enumerate(zip(prompts, cached, strict=True)):
            tokens[row, : len(prompt) - c] = torch.tensor(prompt[c:])
            positions[row] = torch.arange(c, c + t)  # the padding's writes are never read
        positions.clamp_(max=self.columns - 1)
        width = self.width(int(positions.max()) + 1)
        last = torch.tensor(new) - 1
        return self.forward(
            tokens.to(self.device),
            positions.to(self.device),
            torch.tensor(slots, device=self.device),
            width,
            last=last.to(self.device),
        )

    def feed(self, slots: list[int], prompts: Sequence[Sequence[int]], cached: list[int]) -> None:
        """Slots that take their prompts past the first `cached` tokens through decoding steps,
        a token a step: nothing to do here, as each step brings its tokens; a decoder whose
        step does not read them (the replay of `codeloop bench ceiling`) places them here."""

    def slot_kv(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of a slot's first `length` columns: per layer (keys, values), each [KV
        heads, length, head size] (the prefix cache's layout)."""
        copy = self.kv[:, :, slot, :, :length].clone()  # [layers, 2, KVH, length, D]
        return [(copy[i, 0], copy[i, 1]) for i in range(copy.shape[0])]

    def load_kv(self, slot: int, kv: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Write the first `length` columns of a prefix-cache entry into a slot: one copy when
        the entry is `slot_kv`'s (views of one tensor), else one per layer and tensor."""
        whole = kv[0][0]._base
        if whole is not None and whole.shape[:2] == (len(kv), 2) and whole.dim() == 5:
            self.kv[:, :, slot, :, :length] = whole[:, :, :, :length]
            return
        for index, (keys, values) in enumerate(kv):
            self.kv[index, 0, slot, :, :length] = keys[:, :length]
            self.kv[index, 1, slot, :, :length] = values[:, :length]

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], draws: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A token and its logprob for each row of the logits `decode` or `prefill` returned
        (`sampler.sample`). A decoder whose step yields its tokens otherwise (the replay of
        `codeloop bench ceiling`) says how to read them here."""
        return sample(logits, params, draws)

    def move(self, source: int, target: int, length: int) -> None:
        """Copy a slot's first `length` columns to another slot."""
        self.kv[:, :, target, :, :length] = self.kv[:, :, source, :, :length]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache. On the CPU an anonymous memory map of its own: its pages are the kernel's
    shared zero page until written, so the slots and columns a run never fills take no memory
    (64 slots of 1,024 tokens of SmolLM2 in float32 are 2.8 GiB; an evaluation fills a
    fraction). calloc promises that only for memory it maps afresh: one that reuses a freed
    block of the heap writes its zeros there, and every page is taken at once."""
    count = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = torch.frombuffer(mmap.mmap(-1, count), dtype=torch.uint8)  # the tensor holds the map
    return pages.view(dtype).view(shape)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' `apply_rotary_pos_emb` of x ([n, T, heads, D]) at the positions of cos and
    sin ([n, T, D]), with rotate_half's negation folded into `sin_signed`: a roll instead of two
    slices, a negation and a concatenation, to the same values."""
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)
    return x * cos.unsqueeze(2) + rolled * sin_signed.unsqueeze(2)


Norm = tuple[torch.Tensor, float]  # an RMSNorm's weight and epsilon


def _normed(x: torch.Tensor, norm: Norm, gemma: bool) -> torch.Tensor:
    """An RMSNorm of `x` computed as its model does, in float32, in one normalising op instead
    of five: a Llama-family norm scales by w after casting back, Gemma's by (1 + w) before."""
    weight, eps = norm
    normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    if gemma:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    scaled: torch.Tensor = weight * normed.to(x.dtype)
    return scaled


class _Spec(NamedTuple):
    """What a layer's step needs besides tensors, the same for every layer."""

    heads: int
    kv_heads: int
    head_dim: int
    gemma: bool  # (1 + w) norms, norms after attention and the MLP too
    qk_norm: bool
    scaling: float
    act: Any  # the MLP's activation (module), layer 0's
    packed: bool  # the projections' weights are `cpu_linear.pack`'s


class _Spans(NamedTuple):
    """A step's attention by the CPU kernels, one query token a row: row i reads columns
    starts[i] <= c < ends[i] of slot slots[i] (None: slot i). The rows of `chunks` (first row,
    end row, slot: a prompt's consecutive tokens) go to the chunk kernel, which reads their
    keys once for all of them; the rows `alone` to the decoding kernel."""

    kernel: cpu_attention.Kernel
    starts: torch.Tensor  # [n] int64
    ends: torch.Tensor  # [n] int64
    slots: torch.Tensor | None  # [n] int64
    alone: torch.Tensor | None = None  # [m] int64
    chunks: torch.Tensor | None = None  # [c, 3] int64


class _Weights(NamedTuple):
    """A layer's tensors for `_layer` (the model's own, or the decoder's merged copies)."""

    input_norm: Norm
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: Norm | None
    k_norm: Norm | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_attention_norm: Norm
    pre_feedforward_norm: Norm | None  # Gemma's
    gate_up: torch.Tensor
    down: torch.Tensor
    down_bias: torch.Tensor | None
    post_feedforward_norm: Norm | None  # Gemma's


def _layer(
    x: torch.Tensor,
    w: _Weights,
    spec: _Spec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor | _Spans,
    keys: torch.Tensor,
    values: torch.Tensor,
    where: torch.Tensor,
    positions: torch.Tensor,
    read: slice | torch.Tensor,
    width: int,
) -> torch.Tensor:
    """One decoder layer over the slot cache: `x` [n, T, hidden] at `positions` [n, T] of the
    slots `where` [n, T]; its keys and values written to `keys`/`values` [rows, KVH, columns,
    D] (this layer's) and attention over the slots `read` reads, first `width` columns, under
    the additive `mask` [n, 1, group x T, width] (or, one query a row on a CPU, the kernel's
    `_Spans`). Returns the next `x`. A function of tensors, so that `torch.compile` makes one
    program for every layer."""
    n, t = positions.shape
    heads, kv_heads, dim, gemma = spec.heads, spec.kv_heads, spec.head_dim, spec.gemma
    group = heads // kv_heads
    h = _normed(x, w.input_norm, gemma)
    qkv = _linear(h, w.qkv, w.qkv_bias, spec.packed)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = q.view(n, t, heads, dim)
    k = k.view(n, t, kv_heads, dim)
    v = v.view(n, t, kv_heads, dim)
    if w.q_norm is not None and w.k_norm is not None:
        q, k = _normed(q, w.q_norm, gemma), _normed(k, w.k_norm, gemma)
    q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)  # [n, T, heads, D]
    keys[where, :, positions] = k
    values[where, :, positions] = v
    packed = (
        q.view(n, t, kv_heads, group, dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(n, kv_heads, group * t, -1)
    )
    if isinstance(mask, _Spans):
        out = _span_attention(packed, keys, values, mask, spec.scaling)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            packed,
            keys[read, :, :width],
            values[read, :, :width],
            attn_mask=mask,
            scale=spec.scaling,
        )  # [n, KVH, G * T, D]
    out = out.view(n, kv_heads, group, t, -1).permute(0, 3, 1, 2, 4).reshape(n, t, -1)
    attended = _linear(out, w.o_proj, w.o_bias, spec.packed)
    if gemma:
        assert w.pre_feedforward_norm is not None
        x = x + _normed(attended, w.post_attention_norm, gemma)
        h = _normed(x, w.pre_feedforward_norm, gemma)
    else:
        x = x + attended
        h = _normed(x, w.post_attention_norm, gemma)
    gate, up = _linear(h, w.gate_up, None, spec.packed).chunk(2, dim=-1)
    mlp = _linear(spec.act(gate) * up, w.down, w.down_bias, spec.packed)
    if w.post_feedforward_norm is not None:
        mlp = _normed(mlp, w.post_feedforward_norm, gemma)
    return x + mlp


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool
) -> torch.Tensor:
    """`torch.nn.functional.linear`, or `cpu_linear.linear` for a packed weight."""
    if packed:
        return cpu_linear.linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def _span_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, spans: _Spans, scale: float
) -> torch.Tensor:
    """Attention of `query` [n, KVH, G, D] (one token a row) over the slots `keys`/`values`
    [rows, KVH, columns, D] as `spans` says."""
    kernel, slots = spans.kernel, spans.slots
    if spans.chunks is None:
        return kernel(query, keys, values, spans.starts, spans.ends, scale, slots)
    query = query.contiguous()
    out = torch.empty_like(query)
    alone = spans.alone
    if alone is not None and len(alone):
        assert slots is not None
        out[alone] = kernel(
            query[alone], keys, values, spans.starts[alone], spans.ends[alone], scale, slots[alone]
        )
    kernel.chunks(query, keys, values, out, spans.chunks, spans.starts, spans.ends, scale)
    return out


class SlotBatch:
    """The engine's running rows over a `SlotDecoder`: row i of the batch is slot `offset + i`
    and holds `lengths[i]` tokens. The same methods as `KVBatch`."""

    def __init__(self, decoder: SlotDecoder, offset: int, lengths: list[int]) -> None:
        self.decoder, self.offset, self.lengths = decoder, offset, lengths

    @classmethod
    def prefill(
        cls,
        decoder: SlotDecoder,
        prompts: list[list[int]],
        prefixes: PrefixCache,
        *,
        pad_id: int,
        offset: int,
        columns: int,
    ) -> tuple[SlotBatch, torch.Tensor]:
        """The prompts in slots `offset`.., each prefilled past its cached prefix (identical
        prompts once, then copied), and the next-token logits [n, V]; every slot has room for
        `columns` tokens."""
        decoder.ensure_columns(columns)
        first: dict[tuple[int, ...], int] = {}
        for row, prompt in enumerate(prompts):
            first.setdefault(tuple(prompt), row)
        unique = list(first)
        _share_common_prefix(decoder, unique, prefixes, pad_id, slot=offset)
        cached = []
        for key in unique:
            n, entry = prefixes.lookup(key)
            if entry is not None and n:
                decoder.load_kv(offset + first[key], entry.kv, n)
            cached.append(n)
        slots = [offset + first[p] for p in unique]
        logits = decoder.prefill(unique, slots, cached, pad_id)  # [U, V]
        position = {prompt: i for i, prompt in enumerate(unique)}
        for row, ids in enumerate(prompts):
            if first[tuple(ids)] != row:
                decoder.move(offset + first[tuple(ids)], offset + row, len(ids))
        index = [position[tuple(p)] for p in prompts]
        picked = logits[torch.tensor(index, device=logits.device)]
        return cls(decoder, offset, [len(p) for p in prompts]), picked

    @classmethod
    def feed(
        cls,
        decoder: SlotDecoder,
        prompts: list[list[int]],
        prefixes: PrefixCache,
        *,
        offset: int,
        columns: int,
    ) -> tuple[SlotBatch, list[int]]:
        """The prompts in slots `offset`.., each holding the KV of its cached prefix and no
        more, and the tokens cached of each: the rest go in through decoding steps
        (`SlotDecoder.feed`). Every slot has room for `columns` tokens."""
        decoder.ensure_columns(columns)
        cached = []
        for row, prompt in enumerate(prompts):
            n, entry = prefixes.lookup(prompt)
            if entry is not None and n:
                decoder.load_kv(offset + row, entry.kv, n)
            cached.append(n)
        slots = list(range(offset, offset + len(prompts)))
        decoder.feed(slots, prompts, cached)
        return cls(decoder, offset, cached), cached

    def decode(self, _forward: Any, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([n]); the next-token logits [n, V]."""
        assert self.offset == 0, "a joining batch decodes once merged"
        logits = self.decoder.decode(tokens, self.lengths)
        self.lengths = [length + 1 for length in self.lengths]
        return logits

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], draws: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A token and its logprob for each row: the decoder's `sample`."""
        return self.decoder.sample(logits, params, draws)

    def row_kv(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of one row's KV: per layer [KV heads, len, head size]."""
        return self.decoder.slot_kv(self.offset + row, self.lengths[row])

    def select(self, keep: list[int]) -> list[int]:
        """Keep these rows (increasing): each row that leaves a hole below the kept count is
        filled by the last kept row; returns the kept rows in their new order."""
        count, kept = len(keep), set(keep)
        movers = [row for row in keep if row >= count]
        order = []
        for row in range(count):
            if row in kept:
                order.append(row)
            else:
                source = movers.pop()
                self.decoder.move(self.offset + source, self.offset + row, self.lengths[source])
                order.append(source)
        self.lengths = [self.lengths[row] for row in order]
        return order

    def merge(self, other: SlotBatch) -> SlotBatch:
        """This batch's rows, then `other`'s (prefilled in the slots right after them)."""
        assert other.offset == self.offset + len(self.lengths)
        self.lengths += other.lengths
        return self


def _share_common_prefix(
    decoder: SlotDecoder,
    prompts: list[tuple[int, ...]],
    prefixes: PrefixCache,
    pad_id: int,
    *,
    slot: int,
) -> None:
    """Prefill the prompts' common prefix (a system prompt, say) once, in `slot`, and cache
    it, when several prompts share at least `SHARED_PREFIX_MIN` tokens not cached yet."""
    if len(prompts) < 2 or not prefixes.max_tokens:
        return
    shortest = min(len(p) for p in prompts) - 1
    common = min(_common_prefix(prompts[0], p, shortest) for p in prompts[1:])
    cached = prefixes.peek(prompts[0][:common])
    if common - cached < SHARED_PREFIX_MIN:
        return
    head = prompts[0][:common]
    n, entry = prefixes.lookup(head)
    if entry is not None and n:
        decoder.load_kv(slot, entry.kv, n)
    decoder.prefill([head], [slot], [n], pad_id)
    prefixes.store(head, decoder.slot_kv(slot, common))
