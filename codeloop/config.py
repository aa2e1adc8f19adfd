"""One typed config tree: nested dataclasses, TOML files, dotted command-line overrides.

Every field carries its help text and, where it has one, the rStar2-Agent report's value as its
default. `load_config(path, overrides)` reads a TOML file, then applies overrides such as
`--algo.clip_high 0.3`. Unknown keys, wrong types and out-of-range values raise `ConfigError`
with a message that names the key, where it came from (file or command line) and what was
expected. No I/O happens at import; this module imports neither torch nor any engine.

Conventions: there is no `None` in TOML, so "unset" is spelled `0` (numbers: "auto"/"off") or
`""` (strings); the help text of each such field says which.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import operator
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from codeloop.errors import CodeloopError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(CodeloopError, ValueError):
    """A config value is unknown, mistyped or out of range; the message says which and where."""


def knob(
    default: Any,
    help: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A documented config field with optional bounds (inclusive ge/le, exclusive gt/lt)."""
    metadata = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


DEFAULT_PRELOAD = [
    "math",
    "fractions",
    "itertools",
    "collections",
    "functools",
    "numpy",
    "sympy",
    "scipy",
]


# Exercises sympy's solver, simplifier and integrator and numpy's linear algebra on throwaway
# inputs: a fresh child then skips ~20 lazy imports (sympy solve: 58 ms -> 18 ms on a 2-core box).
DEFAULT_WARMUP = (
    "import sympy as sp, numpy as np\n"
    "y = sp.symbols('y')\n"
    "sp.solve(y**2 - 2*y - 8, y); sp.simplify(sp.sin(y)**2 + sp.cos(y)**2)\n"
    "sp.factorint(1234567); sp.integrate(y**2, y); sp.Rational(3, 7) + sp.sqrt(8)\n"
    "np.linalg.solve(np.eye(3), np.ones(3))\n"
)


GRACE_S = 5.0  # a server's drain after SIGTERM/SIGINT (`--grace`; codeloop/serving.py)


@dataclass
class SandboxConfig:
    """Code execution: the warm worker pool, its limits, the HTTP server and the client."""

    urls: list[str] = knob([], "Sandbox servers to spread calls over; empty = in-process pool.")
    token_file: str = knob(
        "",
        "A file whose first line is the sandbox servers' shared secret: the server asks every "
        "request for it, the client sends it. Empty = the variable CODELOOP_TOKEN when set, "
        "else none (any caller is served).",
    )
    tls_cert: str = knob(
        "",
        "The sandbox server's TLS certificate (PEM; with tls_key it serves https://). Empty = "
        "plain HTTP.",
    )
    tls_key: str = knob("", "The private key of tls_cert (PEM).")
    max_connections: int = knob(
        1024,
        "Open connections the sandbox server holds at most; one more is closed as it arrives "
        "(those that send nothing are cut after client_timeout_s).",
        ge=1,
    )
    client_timeout_s: float = knob(
        60.0,
        "The server gives a client this long for a request's line and headers (from its "
        "connection or the answer before) and as long again for its body, then cuts it (the "
        "body: after a 408).",
        gt=0,
    )
    grace_s: float = knob(
        GRACE_S,
        "On SIGTERM/SIGINT the sandbox server answers the calls in flight within this long, "
        "then cancels the rest, closes every connection and exits (about 2 s later).",
        gt=0,
    )
    ca_file: str = knob(
        "",
        "Certificates the client trusts for https:// servers besides the system's (a private "
        "CA, or a server's self-signed certificate).",
    )
    workers: int = knob(0, "Warm worker processes; 0 = one per CPU core.", ge=0)
    timeout_s: float = knob(10.0, "Default wall-clock limit of one call, seconds.", gt=0)
    memory_mb: int = knob(1024, "Default memory limit of one call, MiB.", ge=32)
    max_timeout_s: float = knob(60.0, "Largest timeout a request may ask for, seconds.", gt=0)
    max_memory_mb: int = knob(4096, "Largest memory limit a request may ask for, MiB.", ge=32)
    max_output_bytes: int = knob(65536, "Cap on captured stdout and on stderr, bytes.", ge=1024)
    preload: list[str] = knob(DEFAULT_PRELOAD, "Modules each warm worker imports once.")
    warmup: str = knob(
        DEFAULT_WARMUP,
        "Code each warm worker runs once before forking, so that lazy imports and first-call "
        "set-up are paid once, not per call. Empty = none.",
    )
    require_isolation: bool = knob(False, "Refuse to start unless every isolation feature works.")
    host: str = knob("127.0.0.1", "Address the sandbox server binds to.")
    port: int = knob(8800, "Port of the sandbox server.", ge=1, le=65535)
    max_running: int = knob(
        0,
        "Calls starting or running at once across the workers (a call longer than 0.5 s stops "
        "counting); the rest wait unforked and their timeout has not started. 0 = 4 per CPU "
        "core (codeloop's choice: more only share the cores and slow each other towards their "
        "timeouts).",
        ge=0,
    )
    max_queue: int = knob(1024, "Queued calls before the server answers 429.", ge=1)
    session_idle_timeout_s: float = knob(300.0, "Idle seconds before a session ends.", gt=0)
    max_sessions: int = knob(64, "Live stateful sessions at most.", ge=0)
    client_batch_size: int = knob(64, "Client sends a batch when it holds this many calls.", ge=1)
    client_flush_ms: float = knob(2.0, "Client sends a partial batch after this delay, ms.", ge=0)
    client_retries: int = knob(3, "Retries of infrastructure faults (never of user code).", ge=0)
    client_connect_timeout_s: float = knob(
        3.0,
        "Seconds the client waits for a server that answers nothing (to connect, or to "
        "acknowledge what it was sent) before trying another: a host down or cut off.",
        gt=0,
    )


@dataclass
class RolloutConfig:
    """The multi-turn agent loop, the inference engines and the scheduler."""

    backend: Literal["transformers", "openai"] = knob(
        "transformers", "Engine: in-process transformers, or OpenAI-compatible servers."
    )
    endpoints: list[str] = knob([], "Base URLs of OpenAI-compatible servers (backend=openai).")
    server: Literal["codeloop", "sglang", "vllm"] = knob(
        "codeloop", "What serves rollout.endpoints; it decides how new weights are loaded."
    )
    served_model: str = knob("", "Model name sent to the servers; empty = trainer.model.")
    weights_dir: str = knob(
        "",
        "Where RL writes the weights vLLM or SGLang servers reload (they must see it at this "
        "path: a shared filesystem; codeloop serve gets them over HTTP); empty = "
        "<output_dir>/weights.",
    )
    engine_max_batch: int = knob(
        64,
        "Requests an in-process engine decodes at once (RL's own, codeloop eval --model, the "
        "real recipe's evaluations); on a GPU each holds a slot of the KV cache as long as its "
        "longest request.",
        ge=1,
    )
    engine_step_tokens: int = knob(
        512,
        "Tokens one step of an in-process engine on a CPU forwards: every decoding row's next "
        "token and, in what is left, chunks of waiting prompts (new requests, turns back from "
        "a tool); 0 = each join prefilled in a forward of its own. On a GPU joins are "
        "prefilled or fed a token a step (mixed steps there are not built yet).",
        ge=0,
    )
    kv_capacity_tokens: int = knob(
        0,
        "KV-cache tokens per engine: the kv_aware scheduler's budget of each server (0 = what "
        "each reports; no limit where it reports nothing), and the cap of an in-process engine "
        "(RL's own, codeloop eval --model; 0 = what a quarter of the free memory holds).",
        ge=0,
    )
    reload_check_tol: float = knob(
        0.1,
        "After each weight reload, every server's logprobs of a greedy probe must lie within "
        "this mean absolute difference (nats per token) of the trainer's, else the run stops: "
        "a reload that kept the old weights. 0 = no check (codeloop's choice).",
        ge=0,
    )
    scheduler: Literal["kv_aware", "least_outstanding", "static"] = knob(
        "kv_aware", "How trajectories are assigned to engines (report: kv_aware)."
    )
    server_retry_s: float = knob(
        120.0,
        "Seconds a request is sent again while no server can serve it (down, cut off, "
        "restarting, or being brought up to the current weights) before its trajectory fails.",
        gt=0,
    )
    server_token_file: str = knob(
        "",
        "A file whose first line is the inference servers' shared secret (`codeloop serve "
        "--token-file`, vLLM's --api-key), sent with every request. Empty = the variable "
        "CODELOOP_TOKEN when set, else none.",
    )
    server_ca_file: str = knob(
        "",
        "Certificates trusted for https:// inference servers besides the system's (a private CA, "
        "or `codeloop serve --tls-cert`'s self-signed certificate).",
    )
    server_silent_s: float = knob(
        5.0,
        "Seconds an inference server's host may stay silent (data unacknowledged, keep-alive "
        "probes unanswered; Linux) before its requests are taken as lost and sent elsewhere.",
        gt=0,
    )
    max_turns: int = knob(30, "Assistant turns at most per trajectory.", ge=1)
    max_response_tokens: int = knob(
        8192, "Response budget, model and tool tokens together (report stage 1: 8K).", ge=1
    )
    max_tokens_per_turn: int = knob(0, "Tokens one assistant turn may sample; 0 = no cap.", ge=0)
    tools: list[str] = knob(
        ["python"],
        "Tools the model may call, listed in its prompt: `python` (code in the sandbox) or "
        "`module:Name`, an importable Tool class made with the sandbox (rollout/tools.py).",
    )
    environment: str = knob(
        "",
        "An environment in TRL's form (`module:Name`, as GRPOTrainer's environment_factory): one "
        "instance per trajectory, reset with the problem row's fields, its public methods the "
        "model's tools beside rollout.tools, get_reward() its reward (docs/environments.md); "
        "or an OpenEnv server's URL (http://host:port): a session per trajectory, its action "
        "the `step` tool. Empty = none.",
    )
    environments: dict[str, str] = knob(
        {},
        "Several environments in one run, as TRL's dict form of environment_factory: a table "
        "of name = `module:Name` or an OpenEnv URL; each problem's `environment` field names "
        "its own, and its prompt lists that environment's tools beside rollout.tools "
        "(docs/environments.md). Not with rollout.environment.",
    )
    action_parser: str = knob(
        "",
        "A function (`module:function`) that reads the model's action from its turn's text: "
        "None (no action: the turn ends the trajectory), a call {'name': tool, 'arguments': "
        "{...}}, or a string (an error the model reads); empty = a JSON tool call in "
        "<tool_call> (docs/environments.md).",
    )
    reward_functions: list[str] = knob(
        [],
        "Reward functions in TRL's signature (`module:function`: prompts, completions, "
        "completion_ids, environments and the row's fields, each a list), called once a "
        "trajectory; their values (None left out) and the environment's get_reward() summed "
        "are the reward, in place of the gold answer's (docs/environments.md).",
    )
    reward_weights: list[float] = knob(
        [],
        "Weights of rollout.reward_functions, one each in their order, as TRL's "
        "reward_weights (an environment's get_reward() weighs 1); empty = 1 each.",
    )
    environment_reward: Literal["final", "sum"] = knob(
        "final",
        "An OpenEnv server's reward for a trajectory: the last observation's, or the sum of its "
        "steps' (an environment in TRL's form: its get_reward() either way).",
    )
    temperature: float = knob(1.0, "Sampling temperature during training.", ge=0)
    top_p: float = knob(
        1.0, "Nucleus sampling threshold during training (codeloop's choice: none).", gt=0, le=1
    )
    max_tool_response_chars: int = knob(
        2048, "Tool output shown to the model; longer output keeps head and tail.", ge=64
    )
    chat_template: str = knob(
        "",
        "Path to a Jinja chat template (a path under codeloop/ also finds the installed "
        "package's file); empty = the model's own where it lists tools and renders tool "
        "messages, else codeloop/rollout/rstar2_chat_template.jinja (rStar2-Agent's markup: "
        "Qwen-style turns, tools in the system turn, <reason>), said in one line.",
    )
    system_prompt: str = knob(
        "", "System prompt; empty = codeloop's own wording (rollout/prompt.py), not the report's."
    )
    user_instruction: str = knob(
        "",
        "User turn, with {problem} where the problem goes; empty = codeloop's own wording "
        "(rollout/prompt.py).",
    )


@dataclass
class RewardConfig:
    """Answer extraction and equivalence checking (binary, answer-only reward)."""

    fallback_last_boxed: bool = knob(
        False, "Without <answer>, use the last \\boxed{} of the assistant's own text."
    )
    fallback_answer_phrase: bool = knob(False, "Also accept 'the answer is ...' phrases.")
    fallback_last_number: bool = knob(
        False,
        "When nothing else gave an answer, the last number of the assistant's own text (the "
        "lenient extraction of GSM8K-style scorers; for a model that never learned <answer>).",
    )
    deadline_s: float = knob(5.0, "Hard deadline per symbolic check; overrun scores 0.", gt=0)
    workers: int = knob(0, "Verifier worker processes; 0 = one per CPU core.", ge=0)
    worker_memory_mb: int = knob(
        4096, "Address-space limit of each verifier worker; 0 = no limit.", ge=0
    )


@dataclass
class AlgoConfig:
    """GRPO-RoC: resampling, advantages and the clipped policy loss."""

    group_size: int = knob(16, "G: trajectories kept per prompt (report: 16).", ge=1)
    oversample: int = knob(2, "Sample oversample x G per prompt, keep G (report: 2).", ge=1)
    resample: Literal["roc", "roc_released", "random", "none"] = knob(
        "roc",
        "roc: the report's Resample-on-Correct; roc_released: the released code's "
        "deterministic variant; random: a uniformly random G of those sampled (the ablation "
        "arm that oversamples without selecting); none: plain GRPO on the first G.",
    )
    drop_zero_signal_groups: bool = knob(
        True,
        "Refill the step with more prompts for the groups whose kept rewards are all equal "
        "(report: such groups are dropped). Either way such a group never trains.",
    )
    loss: Literal["token", "gspo"] = knob(
        "token",
        "token: the report's token-level clipped loss, the mean over the step's tokens; gspo: "
        "GSPO's sequence-level ratio (the geometric mean of a sequence's token ratios), clipped "
        "and averaged over the step's sequences (GSPO clips far tighter: clip_low 3e-4, "
        "clip_high 4e-4). codeloop's option.",
    )
    clip_low: float = knob(0.2, "Lower PPO clip: ratio >= 1 - clip_low.", gt=0, lt=1)
    clip_high: float = knob(0.28, "Upper PPO clip (clip-higher): ratio <= 1 + clip_high.", gt=0)
    dual_clip: float = knob(
        0.0, "Dual-clip constant c (> 1) for negative advantages; 0 = off.", ge=0
    )
    adv_eps: float = knob(1e-6, "Added to the group std in the advantage denominator.", gt=0)
    adv_scale: Literal["group", "none"] = knob(
        "group",
        "group: each advantage divided by its group's reward std (GRPO, the report); none: "
        "the reward minus the group mean alone (Dr. GRPO; TRL's scale_rewards).",
    )
    off_policy: Literal["none", "decoupled"] = knob(
        "none",
        "none: the ratio is taken against the logprobs the engine sampled with (behaviour), "
        "as in the report; decoupled: decoupled PPO (Hilton et al. 2022, as AReaL uses it for "
        "asynchronous RL): the trainer recomputes the logprobs of the weights it holds before "
        "the update (the proximal policy), clips the ratio against those, and weights each "
        "token by proximal/behaviour truncated at algo.behaviour_weight_cap (with no lag this "
        "is the truncated importance sampling of Yao et al. 2025). codeloop's option; the "
        "report trains synchronously.",
    )
    behaviour_weight_cap: float = knob(
        2.0, "decoupled: the most a token's proximal/behaviour weight can be.", gt=0
    )


@dataclass
class LoraConfig:
    """LoRA adapters trained instead of the full weights (through peft: the lora extra)."""

    rank: int = knob(0, "Adapter rank; 0 = train the full weights (no LoRA).", ge=0)
    alpha: float = knob(16.0, "Adapter scale numerator: updates are scaled by alpha / rank.", gt=0)
    target_modules: list[str] = knob(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Names of the linear layers that get adapters (the attention and MLP projections of "
        "Llama, Qwen, Mistral and Gemma models).",
    )
    dropout: float = knob(0.0, "Dropout on the adapters' input while training.", ge=0, lt=1)


@dataclass
class TrainerConfig:
    """The policy, optimiser, checkpoints and logs."""

    model: str = knob(
        "Qwen/Qwen3-14B-Base",
        "Model path or hub name (report: Qwen3-14B-Base); `smollm2` or `gemma3-270m`: the "
        "packaged model, imported on first use.",
    )
    output_dir: str = knob("runs/default", "Run directory: checkpoints, logs, trajectories.")
    seed: int = knob(0, "Seed for data order, sampling and resampling.")
    prompts_per_step: int = knob(512, "Prompts per RL step (report: 512).", ge=1)
    max_steps: int = knob(510, "RL steps in all (report: 510 over three stages).", ge=0)
    lr: float = knob(1e-6, "AdamW learning rate (report: 1e-6).", gt=0)
    warmup_steps: int = knob(20, "Linear warm-up steps, then constant (report: 20).", ge=0)
    weight_decay: float = knob(0.01, "AdamW weight decay.", ge=0)
    grad_clip: float = knob(
        1.0, "Gradient-norm clipping threshold (codeloop's choice; the report states none).", gt=0
    )
    updates_per_step: int = knob(1, "Optimiser steps (mini-batches) per rollout batch.", ge=1)
    micro_batch_tokens: int = knob(
        0,
        "Token budget of one micro-batch; 0 = what half of the memory free at the first update "
        "holds (activations and logits; at most 16,384).",
        ge=0,
    )
    gradient_checkpointing: bool = knob(
        False,
        "Recompute each decoder layer's activations in the backward pass instead of keeping "
        "them (TRL's default): a fraction of the memory a token, about a third more compute.",
    )
    recompute_old_logprobs: bool = knob(
        False, "Recompute old logprobs with the trainer instead of using the engine's."
    )
    dtype: Literal["auto", "native", "float32", "bfloat16"] = knob(
        "auto",
        "Compute dtype of training passes (autocast; FSDP2 all-gathers) and of the in-process "
        "engine and evaluated models; auto = bfloat16 on CUDA, float32 on CPU; native = "
        "bfloat16 on CUDA and on CPUs with bfloat16 instructions (AVX512-BF16, AMX-BF16: "
        "bfloat16 matmuls up to ~7x faster than float32), float32 on other CPUs (where "
        "bfloat16 runs ~8x slower). Trained "
        "parameters, gradients and AdamW states stay float32: a step of lr 1e-6 is below "
        "bfloat16's resolution.",
    )
    mode: Literal["sync", "async"] = knob(
        "sync",
        "sync: roll out the whole batch, update, publish, repeat (the report's); async: "
        "generation goes on while the trainer updates on finished groups (codeloop's option, "
        "trainer/async_rl.py).",
    )
    max_staleness: int = knob(
        1,
        "async: a group trains only when its oldest sampled token is at most this many policy "
        "versions old; older groups are regenerated or dropped (trainer.stale_groups).",
        ge=0,
    )
    stale_groups: Literal["regenerate", "drop"] = knob(
        "regenerate",
        "async: what becomes of a group older than trainer.max_staleness: its problem is "
        "sampled again, or it is skipped. Either is counted in the logs.",
    )
    partial_rollout: Literal["continue", "wait"] = knob(
        "continue",
        "async, at a weight update: continue: requests being decoded go on with the new "
        "weights (their earlier tokens keep the old logprobs; the in-process engine only); "
        "wait: the update waits until no request is being decoded and holds new ones back "
        "meanwhile (servers need it). Trajectories in a tool call continue either way.",
    )
    checkpoint_every: int = knob(50, "Steps between checkpoints; 0 = only at the end.", ge=0)
    keep_checkpoints: int = knob(3, "Most recent checkpoints kept on disk.", ge=1)
    eval_every: int = knob(
        0,
        "RL steps between evaluations on eval.data with the run's own engine: eval.k samples "
        "of each problem at the [eval] settings, logged as eval/pass@1 with its 95% interval "
        "(eval/pass@1_low, eval/pass@1_high). 0: none.",
        ge=0,
    )
    loggers: list[Literal["tensorboard", "wandb"]] = knob(
        ["tensorboard"],
        'Where metrics go besides metrics.jsonl: "tensorboard" and/or "wandb" (Weights & '
        "Biases, the wandb extra: pip install 'codeloop[wandb]'; WANDB_MODE=offline works "
        "without a network).",
    )
    wandb_project: str = knob("codeloop", "Weights & Biases project of the run (loggers).")
    profile_step: int = knob(
        0,
        "Run this RL step (counted from 1 in the run directory) under torch.profiler: on a GPU "
        "its log gets profile/gpu_share (the kernels' time over the step's; the rest is the GPU "
        "waiting), and profile_step_NNNNNN.txt the ops that took the most. 0: none.",
        ge=0,
    )
    lora: LoraConfig = field(
        default_factory=LoraConfig,
        metadata={"help": "LoRA adapters instead of the full weights (rank > 0; docs/lora.md)."},
    )


@dataclass
class SFTConfig:
    """Non-reasoning SFT on multi-turn tool-use conversations (the report's stage 0)."""

    data: str = knob("", 'JSONL of {"messages": [...]} conversations with tool calls/results.')
    epochs: int = knob(3, "Passes over the data.", ge=1)
    lr: float = knob(1e-5, "Peak AdamW learning rate (warm-up, then cosine decay).", gt=0)
    min_lr_ratio: float = knob(0.1, "Final learning rate as a fraction of the peak.", ge=0, le=1)
    warmup_steps: int = knob(10, "Linear warm-up steps (when sft.warmup_ratio is 0).", ge=0)
    warmup_ratio: float = knob(
        0.0,
        "Linear warm-up as a fraction of all steps (report: 0.04); 0 = sft.warmup_steps.",
        ge=0,
        lt=1,
    )
    conversations_per_step: int = knob(32, "Conversations per optimiser step.", ge=1)
    packing: Literal["auto", "on", "off"] = knob(
        "auto",
        "Lay conversations end to end in micro-batches instead of padding; auto = when the model "
        "uses FlashAttention (varlen kernels; with sdpa a packed row costs its full square).",
    )
    micro_batch_tokens: int = knob(
        0,
        "Token budget of one micro-batch; 0 = what half of the memory free at the first update "
        "holds (activations and logits; at most 16,384).",
        ge=0,
    )
    max_tokens: int = knob(8192, "Longest conversation kept; longer ones are an error.", ge=1)


@dataclass
class DataConfig:
    """Training problems: where they come from and how they are curated."""

    train: str = knob("", "Training problems: a JSONL/Parquet file or a hub dataset name.")
    problem_field: str = knob("problem", "Field that holds the problem text.")
    answer_field: str = knob(
        "answer",
        "Field that holds the gold answer; empty = none (an environment's get_reward scores "
        "the trajectories: rollout.environment).",
    )
    id_field: str = knob("id", "Field that holds a unique problem id; empty = line number.")
    integer_answers_only: bool = knob(True, "Keep only problems with integer answers (report).")
    decontaminate: list[str] = knob([], "Benchmark files whose 8-grams are removed from training.")
    ngram: int = knob(8, "n of the n-gram decontamination (report: 8).", ge=1)
    rl: str = knob(
        "",
        "What `codeloop real` trains on with RL: empty = the training split's problems after "
        "the SFT ones; gym:TASKS or gym:MIX_FILE = reasoning-gym tasks, scored on held-out "
        "problems of the same mix (the development split beside them).",
    )
    sft_gym: str = knob(
        "",
        "reasoning-gym families whose problems become SFT demonstrations in `codeloop real` "
        "beside GSM8K's (gym:TASKS or gym:MIX_FILE): each problem's program "
        "(data/gym_programs.py), kept when it prints an answer its task scores right; "
        "empty = none. No family may be in two of data.sft_gym, data.rl, data.held_out_gym.",
    )
    held_out_gym: str = knob(
        "",
        "reasoning-gym families in neither SFT nor RL (gym:TASKS or gym:MIX_FILE), scored "
        "after SFT and after RL by `codeloop real`: does the skill carry over? Empty = none.",
    )
    gym_problems: int = knob(
        1000, "Problems drawn when a source is reasoning-gym tasks (gym:lcm,gcd).", ge=1
    )
    gym_seed: int = knob(
        0, "The seed they are drawn with (another seed: other problems, e.g. to evaluate)."
    )


@dataclass
class StageConfig:
    """One stage of a multi-stage recipe."""

    name: str = knob("", "Stage name, used for its run sub-directory.")
    steps: int = knob(0, "RL steps in this stage.", ge=0)
    overrides: dict[str, Any] = knob({}, "Dotted config keys set for this stage only.")
    refilter: bool = knob(
        False,
        "Before the stage keep only the problems whose pass rate "
        "under the policy is within the refilter_*_pass_rate band.",
    )
    refilter_samples: int = knob(8, "Samples per problem when refiltering.", ge=1)
    refilter_max_pass_rate: float = knob(
        0.99, "Keep problems whose pass rate is at most this.", ge=0, le=1
    )
    refilter_min_pass_rate: float = knob(
        0.0,
        "Keep problems whose pass rate is at least this (above 0: drop the problems the "
        "policy never solves, whose groups carry no signal).",
        ge=0,
        le=1,
    )
    reset_optimizer: bool = knob(False, "Start the stage with a fresh optimiser state.")
    harder: str = knob(
        "",
        "With refilter, on reasoning-gym problems: a gym mix (gym:MIX_FILE or gym:TASKS) of "
        "harder settings. A family whose screened problems the policy solves on average more "
        "often than refilter_max_pass_rate gets as many new problems drawn from its settings "
        "here, screened with the rest: RL keeps a signal as it learns. Empty = none.",
    )


@dataclass
class RecipeConfig:
    """A list of stages run in order, each continuing from the previous policy."""

    stages: list[StageConfig] = knob([], "Stages in order; empty = one stage of trainer.max_steps.")


@dataclass
class EvalConfig:
    """Evaluation protocol (defaults: the report's)."""

    k: int = knob(16, "Samples per problem (avg@k, pass@k, maj@k).", ge=1)
    temperature: float = knob(0.6, "Sampling temperature (report: 0.6).", ge=0)
    top_p: float = knob(0.95, "Nucleus sampling threshold (codeloop's choice).", gt=0, le=1)
    max_turns: int = knob(30, "Assistant turns at most (report: 30).", ge=1)
    max_response_tokens: int = knob(
        32768, "Response budget per trajectory (codeloop's choice).", ge=1
    )
    data: str = knob(
        "", "Held-out problems scored during RL every trainer.eval_every steps (as data.train)."
    )


@dataclass
class Config:
    """The whole tree."""

    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# ---------------------------------------------------------------------------------------------
# Building and checking


def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, globalns=vars(sys.modules[__name__]))


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return "a table"
    if dataclasses.is_dataclass(tp):
        return "a table"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp)
    )


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the field type `tp`; return it converted (int -> float, tables)."""
    origin = get_origin(tp)
    bad = ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin in (Union, types.UnionType):  # "unset" is 0 or "" instead (see module docstring)
        raise ConfigError(f"{where}: unions are not supported in the config tree")
    if origin is Literal:
        if value not in get_args(tp):
            raise bad
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad
        item = get_args(tp)[0]
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        item = get_args(tp)[1]
        if item is Any:
            return dict(value)
        return {k: _coerce(v, item, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad
        return _build(tp, value, where)  # type: ignore[arg-type]
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    raise ConfigError(f"{where}: unsupported field type {tp}")


def _check_range(f: dataclasses.Field[Any], value: Any, where: str) -> None:
    bounds = [
        ("ge", ">=", operator.ge),
        ("gt", ">", operator.gt),
        ("le", "<=", operator.le),
        ("lt", "<", operator.lt),
    ]
    for key, symbol, holds in bounds:
        bound = f.metadata.get(key)
        if bound is not None and not holds(value, bound):
            raise ConfigError(f"{where}: must be {symbol} {bound}, got {value!r}")


def _unknown_key(cls: type, key: str, where: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return ConfigError(f"{where}: unknown key; {hint}{cls.__name__} has: {', '.join(names)}")


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    hints = _hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        key_where = f"{where}.{key}" if where else key
        if key not in by_name:
            raise _unknown_key(cls, key, key_where)
        kwargs[key] = _coerce(value, hints[key], key_where)
        _check_range(by_name[key], kwargs[key], key_where)
    return cls(**kwargs)


def _flatten(table: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted, value


def _resolve(cfg: Config, dotted: str) -> tuple[Any, dataclasses.Field[Any], Any]:
    """Find the object holding `dotted`'s last field; return (holder, field, field type)."""
    parts = dotted.split(".")
    holder: Any = cfg
    for i, part in enumerate(parts):
        path = ".".join(parts[: i + 1])
        if isinstance(holder, list):
            if not part.isdigit() or int(part) >= len(holder):
                raise ConfigError(f"{path}: expected an index below {len(holder)}")
            holder = holder[int(part)]
            continue
        by_name = {f.name: f for f in dataclasses.fields(holder)}
        if part not in by_name:
            raise _unknown_key(type(holder), part, path)
        f, tp = by_name[part], _hints(type(holder))[part]
        if i == len(parts) - 1:
            return holder, f, tp
        is_table_list = get_origin(tp) is list and dataclasses.is_dataclass(get_args(tp)[0])
        if not (dataclasses.is_dataclass(tp) or is_table_list):
            raise ConfigError(f"{path}: is {_type_name(tp)}, not a table")
        holder = getattr(holder, part)
    raise ConfigError(f"{dotted}: names a section, not a field")


def set_value(cfg: Config, dotted: str, value: Any, source: str) -> None:
    """Set one dotted key on `cfg` in place, with the same checks as a file value."""
    try:
        holder, f, tp = _resolve(cfg, dotted)
        if dataclasses.is_dataclass(tp):
            raise ConfigError(f"{dotted}: names a section, not a field")
        coerced = _coerce(value, tp, dotted)
        _check_range(f, coerced, dotted)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    setattr(holder, f.name, coerced)


def _parse_cli_value(cfg: Config, dotted: str, text: str) -> Any:
    """Command-line values are TOML literals (`0.3`, `true`, `["a", "b"]`); strings may be bare."""
    try:
        _, _, tp = _resolve(cfg, dotted)
    except ConfigError as err:
        raise ConfigError(f"command line: {err}") from None
    if tp is str or (get_origin(tp) is Literal and isinstance(get_args(tp)[0], str)):
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(
            f"command line: {dotted}: expected {_type_name(tp)}, got {text!r}"
        ) from None


def parse_overrides(args: Sequence[str]) -> list[tuple[str, str]]:
    """`["--algo.clip_high", "0.3", "--trainer.seed=1"]` -> `[("algo.clip_high", "0.3"), ...]`."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(
                f"command line: expected an override like --section.key VALUE, got {arg!r}"
            )
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"command line: {arg} needs a value")
            key, text = arg[2:], args[i + 1]
            i += 2
        pairs.append((key, text))
    return pairs


def _check_stage_overrides(cfg: Config, source: str) -> None:
    for i, stage in enumerate(cfg.recipe.stages):
        if stage.refilter_min_pass_rate > stage.refilter_max_pass_rate:
            raise ConfigError(
                f"{source}: recipe.stages[{i}]: refilter_min_pass_rate "
                f"{stage.refilter_min_pass_rate} > refilter_max_pass_rate "
                f"{stage.refilter_max_pass_rate} keeps no problem"
            )
        trial = copy.deepcopy(cfg)
        for key, value in _flatten(stage.overrides):
            if key.startswith("recipe."):
                raise ConfigError(
                    f"{source}: recipe.stages[{i}].overrides.{key}: a stage "
                    "cannot change the recipe"
                )
            set_value(trial, key, value, f"{source}: recipe.stages[{i}].overrides")


PACKAGED_CONFIGS = Path(__file__).with_name("configs")  # the recipes' configs, in the package


def config_path(path: str | Path) -> Path:
    """`path`, or where it does not exist and names one of the package's configs (`NAME.toml`
    or `configs/NAME.toml`), that one: the recipes' configs work outside a checkout."""
    given = Path(path)
    packaged = PACKAGED_CONFIGS / given.name
    named = len(given.parts) == 1 or given.parts[-2:-1] == ("configs",)
    if not given.exists() and named and packaged.is_file():
        return packaged
    return given


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the TOML file at `path` (if any; `config_path` resolves it), then
    command-line `overrides`."""
    cfg = Config()
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            with open(config_path(path), "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            packaged = ", ".join(sorted(p.name for p in PACKAGED_CONFIGS.glob("*.toml")))
            raise ConfigError(
                f"{source}: no such config file (the package's own: {packaged})"
            ) from None
        except IsADirectoryError:
            raise ConfigError(f"{source}: is a directory; expected a TOML file") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"{source}: not valid TOML: {err}") from None
        try:
            cfg = _build(Config, data, "")
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None
    apply_overrides(cfg, overrides)
    _check_stage_overrides(cfg, source)
    if 0 < cfg.algo.dual_clip <= 1:  # c <= 1 would cap a negative advantage below its clip
        raise ConfigError(
            f"{source}: algo.dual_clip: must be 0 (off) or > 1, got {cfg.algo.dual_clip}"
        )
    if cfg.algo.loss == "gspo" and cfg.algo.off_policy == "decoupled":
        raise ConfigError(
            f"{source}: algo.loss gspo takes one ratio per sequence; "
            "algo.off_policy decoupled weights tokens: choose one"
        )
    return cfg


def apply_overrides(cfg: Config, overrides: Sequence[str]) -> None:
    """Set the dotted command-line `overrides` (`--algo.clip_high 0.3`) on `cfg`."""
    for key, text in parse_overrides(overrides):
        set_value(cfg, key, _parse_cli_value(cfg, key, text), "command line")


def eval_rollout_config(cfg: Config) -> RolloutConfig:
    """The rollout settings with the `[eval]` section's sampling and budgets."""
    e = cfg.eval
    return dataclasses.replace(
        cfg.rollout,
        temperature=e.temperature,
        top_p=e.top_p,
        max_turns=e.max_turns,
        max_response_tokens=e.max_response_tokens,
    )


POLICY_SETTINGS = "codeloop.json"  # beside a saved policy: how it is prompted and evaluated
POLICY_TEMPLATE = "codeloop_chat_template.jinja"  # the chat template it was trained with


def apply_policy_settings(cfg: Config, directory: str | Path) -> bool:
    """Set `cfg`'s prompt format (`rollout.chat_template`, `system_prompt`, `user_instruction`),
    the turn budgets it was trained with (`rollout.max_tokens_per_turn`,
    `max_tool_response_chars`) and `[eval]` from the `POLICY_SETTINGS` a trained policy's
    directory holds; whether it held one. A policy is then prompted and sampled as it was
    trained without the config that trained it (command-line overrides come after)."""
    path = Path(directory) / POLICY_SETTINGS
    if not path.is_file():
        return False
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err.msg})") from None
    rollout = dict(saved.get("rollout", {}))
    if rollout.get("chat_template"):
        rollout["chat_template"] = str(Path(directory) / rollout["chat_template"])
    for section, values in (("rollout", rollout), ("eval", saved.get("eval", {}))):
        for key, value in values.items():
            set_value(cfg, f"{section}.{key}", value, str(path))
    return True


def stage_config(cfg: Config, index: int) -> Config:
    """The config a recipe stage runs with: `cfg` plus the stage's overrides."""
    stage = cfg.recipe.stages[index]
    resolved = copy.deepcopy(cfg)
    for key, value in _flatten(stage.overrides):
        set_value(resolved, key, value, f"recipe.stages[{index}].overrides")
    return resolved


# ---------------------------------------------------------------------------------------------
# Printing


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in _flatten(value))
        return "{" + items + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def _toml_table(obj: Any, header: str, with_help: bool) -> list[str]:
    lines = [f"[{header}]"] if header else []
    nested: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            nested.append((f.name, value))
            continue
        if dataclasses.is_dataclass(value):
            nested.append((f.name, value))
            continue
        if with_help and f.metadata.get("help"):
            lines.append(f"# {f.metadata['help']}")
        lines.append(f"{f.name} = {_toml_value(value)}")
    for name, value in nested:
        sub = f"{header}.{name}" if header else name
        if isinstance(value, list):
            for item in value:
                lines += ["", f"[[{sub}]]", *_toml_table(item, "", False)]
        else:
            lines += ["", *_toml_table(value, sub, with_help)]
    return lines


def to_toml(cfg: Config, with_help: bool = True) -> str:
    """The resolved config as TOML that `load_config` reads back to an equal `Config`."""
    return "\n".join(_toml_table(cfg, "", with_help)).lstrip("\n") + "\n"
