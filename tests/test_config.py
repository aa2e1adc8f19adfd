import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest

from codeloop.config import (
    AlgoConfig,
    Config,
    ConfigError,
    load_config,
    parse_overrides,
    stage_config,
    to_toml,
)

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, text: str, name: str = "exp.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_are_the_papers() -> None:
    cfg = Config()
    assert (cfg.algo.group_size, cfg.algo.oversample) == (16, 2)
    assert (cfg.algo.clip_low, cfg.algo.clip_high) == (0.2, 0.28)
    assert cfg.algo.resample == "roc"
    assert (cfg.trainer.lr, cfg.trainer.warmup_steps, cfg.trainer.grad_clip) == (1e-6, 20, 1.0)
    assert cfg.trainer.prompts_per_step == 512
    assert cfg.rollout.max_response_tokens == 8192
    assert (cfg.eval.temperature, cfg.eval.max_turns) == (0.6, 30)


def test_every_field_is_documented() -> None:
    def walk(cls: type) -> list[str]:
        missing = []
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.type) or f.name in {
                "sandbox",
                "rollout",
                "reward",
                "algo",
                "trainer",
                "sft",
                "data",
                "recipe",
                "eval",
            }:
                continue
            if not f.metadata.get("help"):
                missing.append(f"{cls.__name__}.{f.name}")
        return missing

    from codeloop import config as module

    sections = [
        v for v in vars(module).values() if isinstance(v, type) and dataclasses.is_dataclass(v)
    ]
    assert len(sections) >= 10
    assert [name for cls in sections for name in walk(cls)] == []


def test_file_values_and_overrides_apply_in_order(tmp_path: Path) -> None:
    path = _write(tmp_path, "[algo]\nclip_high = 0.3\ngroup_size = 8\n[trainer]\nlr = 2e-6\n")
    cfg = load_config(path, ["--algo.clip_high", "0.35", "--trainer.model=org/name-1.5B"])
    assert cfg.algo.clip_high == 0.35  # command line beats file
    assert cfg.algo.group_size == 8
    assert cfg.trainer.lr == 2e-6
    assert cfg.trainer.model == "org/name-1.5B"  # bare strings need no quotes
    assert cfg.algo.clip_low == 0.2  # untouched default


def test_integer_is_accepted_for_a_float_field(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "[sandbox]\ntimeout_s = 3\n"))
    assert cfg.sandbox.timeout_s == 3.0
    assert isinstance(cfg.sandbox.timeout_s, float)


def test_list_override_parses_as_toml() -> None:
    cfg = load_config(None, ["--sandbox.urls", '["http://a:8800", "http://b:8800"]'])
    assert cfg.sandbox.urls == ["http://a:8800", "http://b:8800"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[algo]\nclip_hgh = 0.3\n",
            "exp.toml: algo.clip_hgh: unknown key; did you mean 'clip_high'?",
        ),
        ("[algoo]\nclip_high = 0.3\n", "exp.toml: algoo: unknown key; did you mean 'algo'?"),
        ('[algo]\nclip_high = "big"\n', "exp.toml: algo.clip_high: expected a number, got 'big'"),
        ("[algo]\ngroup_size = 1.5\n", "exp.toml: algo.group_size: expected an integer, got 1.5"),
        ("[algo]\ngroup_size = true\n", "exp.toml: algo.group_size: expected an integer, got True"),
        ("[algo]\nclip_low = 1.5\n", "exp.toml: algo.clip_low: must be < 1, got 1.5"),
        ("[algo]\ngroup_size = 0\n", "exp.toml: algo.group_size: must be >= 1, got 0"),
        (
            '[algo]\nresample = "rock"\n',
            "exp.toml: algo.resample: expected one of 'roc', 'roc_released', 'random', 'none', "
            "got 'rock'",
        ),
        (
            '[sandbox]\nurls = "http://a"\n',
            "exp.toml: sandbox.urls: expected a list of a string, got 'http://a'",
        ),
        ("algo = 3\n", "exp.toml: algo: expected a table, got 3"),
        (
            "[algo]\nclip_high = \n",
            "exp.toml: not valid TOML: Invalid value (at line 2, column 13)",
        ),
        (
            '[[recipe.stages]]\nname = "s"\nstepz = 3\n',
            "exp.toml: recipe.stages[0].stepz: unknown key; did you mean 'steps'?",
        ),
    ],
)
def test_file_errors_name_file_key_and_expectation(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, text))
    assert message.split("exp.toml: ", 1)[1] in str(err.value)
    assert str(err.value).startswith(str(tmp_path / "exp.toml") + ": ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--algo.clip_hihg", "0.3"], "command line: algo.clip_hihg: unknown key; did you mean"),
        (["--algo.clip_high", "abc"], "command line: algo.clip_high: expected a number, got 'abc'"),
        (["--algo.clip_high", "-1"], "command line: algo.clip_high: must be > 0, got -1.0"),
        (["--rollout.scheduler", "fifo"], "command line: rollout.scheduler: expected one of"),
        (["--algo", "1"], "command line: expected an override like --section.key VALUE"),
        (["--algo.clip_high"], "command line: --algo.clip_high needs a value"),
        (
            ["--recipe.stages.0.steps", "3"],
            "command line: recipe.stages.0: expected an index below 0",
        ),
        (["--algo.clip_high.x", "3"], "command line: algo.clip_high: is a number, not a table"),
        (["--sandbox", "x"], "command line: expected an override"),
        (["--trainer.seed", "1.5"], "command line: trainer.seed: expected an integer, got 1.5"),
        (["--algo.dual_clip", "0.5"], "algo.dual_clip: must be 0 (off) or > 1, got 0.5"),
    ],
)
def test_override_errors_name_the_key(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, args)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.toml: no such config file"):
        load_config(tmp_path / "nope.toml")


def test_parse_overrides_accepts_both_spellings() -> None:
    assert parse_overrides(["--a.b", "1", "--c.d=x=y", "--e.f", "-2"]) == [
        ("a.b", "1"),
        ("c.d", "x=y"),
        ("e.f", "-2"),
    ]


def test_paper_recipe_loads_and_stage_overrides_apply() -> None:
    cfg = load_config(REPO / "configs" / "rstar2_agent.toml")
    assert [s.name for s in cfg.recipe.stages] == ["stage1-8k", "stage2-12k", "stage3-hard-12k"]
    assert sum(s.steps for s in cfg.recipe.stages) == cfg.trainer.max_steps == 510
    assert [stage_config(cfg, i).rollout.max_response_tokens for i in range(3)] == [
        8192,
        12288,
        12288,
    ]
    assert cfg.rollout.max_response_tokens == 8192  # the base is not modified
    assert cfg.recipe.stages[2].refilter and cfg.recipe.stages[2].reset_optimizer


def test_paper_recipe_has_the_reports_turn_limits_and_sft() -> None:
    cfg = load_config(REPO / "configs" / "rstar2_agent.toml")
    assert [stage_config(cfg, i).rollout.max_turns for i in range(3)] == [10, 10, 15]
    assert cfg.eval.max_turns == 30
    sft = cfg.sft
    assert (sft.epochs, sft.lr, sft.warmup_ratio, sft.conversations_per_step) == (
        3,
        5e-6,
        0.04,
        128,
    )
    assert cfg.algo.drop_zero_signal_groups and cfg.algo.resample == "roc"


def test_bad_stage_override_is_caught_at_load_time(tmp_path: Path) -> None:
    text = '[[recipe.stages]]\nname = "s1"\nsteps = 2\noverrides = { "rollout.max_turnz" = 3 }\n'
    with pytest.raises(
        ConfigError, match=r"recipe.stages\[0\].overrides: rollout.max_turnz: unknown key"
    ):
        load_config(_write(tmp_path, text))
    text = '[[recipe.stages]]\nname = "s1"\n[recipe.stages.overrides.algo]\nclip_high = -1\n'
    with pytest.raises(ConfigError, match="algo.clip_high: must be > 0, got -1"):
        load_config(_write(tmp_path, text))


def test_a_refilter_band_that_keeps_nothing_is_refused_at_load_time(tmp_path: Path) -> None:
    text = (
        '[[recipe.stages]]\nname = "s1"\nrefilter = true\nrefilter_min_pass_rate = 0.8\n'
        "refilter_max_pass_rate = 0.5\n"
    )
    with pytest.raises(
        ConfigError,
        match=r"exp.toml: recipe.stages\[0\]: refilter_min_pass_rate "
        r"0.8 > refilter_max_pass_rate 0.5 keeps no problem",
    ):
        load_config(_write(tmp_path, text))
    with pytest.raises(ConfigError, match=r"recipe.stages\[0\]: refilter_min_pass_rate 0.6 >"):
        load_config(
            _write(tmp_path, '[[recipe.stages]]\nname = "s1"\n'),
            [
                "--recipe.stages.0.refilter_min_pass_rate",
                "0.6",
                "--recipe.stages.0.refilter_max_pass_rate",
                "0.5",
            ],
        )


def test_to_toml_reads_back_to_an_equal_config(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "rstar2_agent.toml", ["--algo.dual_clip", "3"])
    text = to_toml(cfg)
    assert "# Upper PPO clip (clip-higher)" in text  # help text travels as comments
    assert load_config(_write(tmp_path, text, "shown.toml")) == cfg
    assert tomllib.loads(to_toml(Config(), with_help=False))["algo"] == dataclasses.asdict(
        AlgoConfig()
    )


def test_a_config_that_is_a_directory_or_binary_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"is a directory; expected a TOML file"):
        load_config(tmp_path)
    binary = tmp_path / "x.toml"
    binary.write_bytes(b"\xff\xfe\x00key = 1")
    with pytest.raises(ConfigError, match=r"x.toml: not valid TOML"):
        load_config(binary)
    with pytest.raises(
        ConfigError,
        match=r"no such config file \(the package's own: .*"
        r"gsm8k_smollm2.toml",
    ):
        load_config(tmp_path / "missing.toml")


def test_the_package_configs_are_found_by_name_from_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from codeloop.config import PACKAGED_CONFIGS, config_path

    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert config_path("configs/gsm8k_smollm2.toml") == PACKAGED_CONFIGS / "gsm8k_smollm2.toml"
    assert config_path("rstar2_agent.toml") == PACKAGED_CONFIGS / "rstar2_agent.toml"
    assert load_config("configs/gsm8k_smollm2_gpu.toml").rollout.engine_max_batch == 256
    (tmp_path / "configs").mkdir()
    mine = tmp_path / "configs" / "gsm8k_smollm2.toml"
    mine.write_text("[trainer]\nseed = 7\n")  # a file of the user's own comes first
    assert config_path("configs/gsm8k_smollm2.toml") == Path("configs/gsm8k_smollm2.toml")
    assert load_config("configs/gsm8k_smollm2.toml").trainer.seed == 7
    assert config_path("elsewhere/gsm8k_smollm2.toml") == Path("elsewhere/gsm8k_smollm2.toml")


def test_policy_settings_set_the_prompt_format_and_eval(tmp_path: Path) -> None:
    from codeloop.config import apply_policy_settings

    cfg = load_config()
    assert apply_policy_settings(cfg, tmp_path) is False  # nothing saved: nothing changes
    assert cfg.rollout.chat_template == "" and cfg.eval.max_turns == 30
    (tmp_path / "codeloop.json").write_text(
        json.dumps(
            {
                "rollout": {
                    "chat_template": "t.jinja",
                    "system_prompt": "S",
                    "user_instruction": "{problem}",
                },
                "eval": {"max_turns": 8, "temperature": 0.6, "max_response_tokens": 1024},
            }
        )
    )
    assert apply_policy_settings(cfg, tmp_path) is True
    assert cfg.rollout.chat_template == str(tmp_path / "t.jinja")  # beside the weights
    assert (cfg.rollout.system_prompt, cfg.eval.max_turns, cfg.eval.max_response_tokens) == (
        "S",
        8,
        1024,
    )
    (tmp_path / "codeloop.json").write_text('{"eval": {"max_turns": 0}}')
    with pytest.raises(ConfigError, match=r"codeloop.json: eval.max_turns"):
        apply_policy_settings(cfg, tmp_path)
    (tmp_path / "codeloop.json").write_text("{oops")
    with pytest.raises(ConfigError, match=r"codeloop.json: not valid JSON"):
        apply_policy_settings(cfg, tmp_path)


def test_gspo_with_decoupled_weights_is_refused() -> None:
    with pytest.raises(ConfigError, match="algo.loss gspo takes one ratio per sequence"):
        load_config(None, ["--algo.loss", "gspo", "--algo.off_policy", "decoupled"])
    assert load_config(None, ["--algo.loss", "gspo"]).algo.loss == "gspo"
