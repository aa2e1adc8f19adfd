"""How much of GSM8K `codeloop real` uses, on a CPU and on one GPU (no heavy imports: the
command line's help reads these)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Sizes:
    """How much of everything (`codeloop real --help` sets them)."""

    dev: int = 500  # held out from GSM8K's training split, never trained on
    # Scored after SFT and after the last stage (each stage too with eval_every_stage). Over a
    # fixed number of trajectories, more problems narrow the interval of a paired difference
    # more than more samples of the same problems (samples of one problem are correlated), and
    # two evaluations cost less than four: the whole development split, once each.
    eval_problems: int = 500
    eval_samples: int = 1
    eval_every_stage: bool = False
    sft_problems: int = 1200  # training problems whose solutions become SFT conversations
    rl_problems: int = 120  # training problems after those, screened by stage 1 for RL
    # Fresh samples of each problem RL trained on, scored with the SFT policy and the final one
    # at the [eval] settings: the direct check that RL moved the policy where it trained.
    trained_samples: int = 8
    error_share: float = 0.15  # of the SFT conversations: a real tool error, then the fix
    # With RL on another task (data.rl: a gym mix), the development problems scored beside
    # its held-out ones after SFT and after RL, once each
    dev_beside: int = 200
    # With data.sft_gym: problems of those families drawn for SFT demonstrations (those whose
    # program prints an answer its task scores right become conversations, beside GSM8K's)
    sft_gym_problems: int = 240
    sft_family_problems: int = 100  # of those families (other problems), scored beside
    # With data.held_out_gym: problems of the families in neither SFT nor RL, scored beside
    # the held-out ones after SFT and after RL, once each
    held_out_family_problems: int = 200


CPU_CONFIG = "configs/gsm8k_smollm2.toml"  # the package's own (config.config_path)
GPU_CONFIG = "configs/gsm8k_smollm2_gpu.toml"
# One GPU, sized from the rates measured on an H200 (evaluations at ~16 trajectories/s, screens
# and RL sampling at ~19, SFT in about a minute): SFT on 5,973 solutions, 500 x 2 development
# scores (~64 s each), 300 problems screened x 4 (~63 s; the screens kept 8% in [0.25, 0.75],
# ~24 problems), 12 RL steps of 16 x 16 samples (~17 s each), within 9 minutes. On an H100:
# SFT 1.4 min, evaluations 35-40 s, 18 of 300 kept, RL steps ~20 s (docs/benchmarks.md).
GPU_SIZES = Sizes(
    dev=500,
    eval_problems=500,
    eval_samples=2,
    sft_problems=5973,
    rl_problems=300,
    trained_samples=4,
)
GPU_MINUTES = 9.0  # the GPU recipe's time limit (`codeloop real --time-limit`)


class ModelRecipe(NamedTuple):
    """A packaged model's CPU recipe."""

    config: str
    sizes: Sizes
    minutes: float  # `codeloop real --time-limit` (0: none)
    overrides: tuple[str, ...] = ()  # dotted options before the user's own


# `codeloop real --model NAME`: the packaged models (`data/pretrained.py`), each with the config,
# the CPU sizes and the CPU time limit of its recipe (minutes; 0: none). Gemma 3 270M costs
# twice SmolLM2's compute a token (536 against 270 MFLOP; its output layer is two thirds of it)
# and samples ~0.3 trajectories/s on two cores: fewer SFT solutions and development problems,
# fewer problems screened, and a limit that stops RL where the last evaluation still fits in 90
# minutes (measured: 80 min, SFT 20, each evaluation 12, the screen 15, one RL step 15).
GEMMA3_SIZES = Sizes(
    dev=500, eval_problems=200, sft_problems=300, rl_problems=64, trained_samples=4
)
MODEL_RECIPES = {
    "smollm2": ModelRecipe(CPU_CONFIG, Sizes(), 0.0),
    "gemma3-270m": ModelRecipe("configs/gsm8k_gemma3.toml", GEMMA3_SIZES, 85.0),
}

# `codeloop real --task gym` (configs/gym_smollm2.toml): SFT on GSM8K's solutions (fewer: the
# format and the tool, not the task) and on the programs of 240 problems of the SFT families;
# RL on the RL families (96 problems screened x 4); scored after SFT and after RL on 320
# held-out problems of the RL families, 120 of the SFT families, 300 of the families in neither
# and 60 development problems, once each (more problems narrow a paired interval more than more
# samples), within an hour on two cores. At the ~3.8 gym trajectories/s of a 2-core AMD EPYC
# with mixed engine steps, each evaluation takes about 4 minutes.
GYM_SIZES = Sizes(
    dev=500,
    eval_problems=320,
    eval_samples=1,
    sft_problems=300,
    rl_problems=96,
    trained_samples=2,
    dev_beside=60,
    sft_gym_problems=240,
    sft_family_problems=120,
    held_out_family_problems=300,
)
# The same with Gemma 3 270M (configs/gym_gemma3.toml), within its 90 minutes: a token costs
# it twice SmolLM2's compute, most of it in the output layer, which the attention kernel does
# not touch. Fewer SFT solutions, 200 held-out problems of the RL families, 80 of the SFT
# families, 200 of the families in neither and 50 development problems (~530 trajectories, ~7
# minutes at Gemma's ~1.3 trajectories/s), a smaller screen; the limit (85 min, as for its
# GSM8K recipe) stops RL where the last evaluations still fit.
GYM_GEMMA3_SIZES = Sizes(
    dev=500,
    eval_problems=200,
    eval_samples=1,
    sft_problems=240,
    rl_problems=48,
    trained_samples=2,
    dev_beside=50,
    sft_gym_problems=240,
    sft_family_problems=80,
    held_out_family_problems=200,
)
# `codeloop real --task NAME [--model NAME]`: the recipe of each task for each packaged model
# that has one
TASK_RECIPES = {
    "gym": {
        "smollm2": ModelRecipe("configs/gym_smollm2.toml", GYM_SIZES, 60.0),
        "gemma3-270m": ModelRecipe("configs/gym_gemma3.toml", GYM_GEMMA3_SIZES, 85.0),
    },
}

# `codeloop real --long`: SmolLM2's recipe with RL long enough to move the problems it trains on
# (a night on a laptop, or up to ~2.5 hours on two cores). A screen of 300 problems is expected
# to keep ~25 that the SFT policy solves sometimes (it kept 4-11 of 120), and the stages ask for
# more steps than are planned to fit: the limit stops RL where the last evaluation and the
# trained problems' two scores still fit (planned from make real's ~110 s a step: ~35 steps).
LONG_STEPS = (16, 12, 12)  # of the three stages of CPU_CONFIG
LONG_RECIPE = ModelRecipe(
    CPU_CONFIG,
    Sizes(rl_problems=300),
    150.0,
    (
        "--trainer.output_dir=runs/real-long",
        *(f"--recipe.stages.{i}.steps={n}" for i, n in enumerate(LONG_STEPS)),
    ),
)
