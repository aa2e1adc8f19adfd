"""Mutation testing of the core modules: does the suite notice a small bug?

`python tests/mutate.py [--only NAME] [--out FILE]` (or `make mutate`) plants one small bug at a
time in the modules of TARGETS (a comparison turned around, an operator swapped, a constant moved
by one, a condition negated, `and` for `or`, ...), runs the tests that guard that module (those
not marked slow, unless SLOW_GUARDS names the module: two ranks under torchrun, say), and
counts the mutant as killed when they fail (or hang past a time limit). It prints, and writes as
Markdown to FILE, a table of mutants, killed and survivors by module, then every survivor with
its line, so that each is either killed by a new test or named as harmless.

The mutants run in a copy of the package, never in the working tree; Python's bytecode cache is
off there (a mutant the size of the original, written within the same second, would otherwise
run the original's cached bytecode). One process imports the heavy libraries once and forks a
child per mutant that imports the (mutated) package afresh and runs pytest.
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# module -> (functions to mutate, or None for all; the tests that guard it)
TARGETS: dict[str, tuple[list[str] | None, list[str]]] = {
    "codeloop/algo/advantage.py": (None, ["tests/algo"]),
    "codeloop/algo/loss.py": (None, ["tests/algo", "tests/trainer/test_learner.py"]),
    "codeloop/algo/resample.py": (None, ["tests/algo"]),
    "codeloop/reward/extract.py": (None, ["tests/reward/test_extract.py"]),
    "codeloop/reward/integer.py": (
        None,
        [
            "tests/reward/test_integer.py",
            "tests/reward/test_forms.py",
            "tests/reward/test_symbolic.py",
        ],
    ),
    "codeloop/reward/forms.py": (
        None,
        ["tests/reward/test_forms.py", "tests/reward/test_agreement.py"],
    ),
    "codeloop/reward/symbolic.py": (
        None,
        ["tests/reward/test_symbolic.py", "tests/reward/test_forms.py"],
    ),
    "codeloop/reward/fastpath.py": (
        None,
        ["tests/reward/test_forms.py", "tests/reward/test_symbolic.py"],
    ),
    "codeloop/reward/verifier.py": (None, ["tests/reward/test_verifier.py"]),
    "codeloop/rollout/agent.py": (
        None,
        [
            "tests/rollout/test_agent.py",
            "tests/rollout/test_collect.py",
            "tests/engine/test_openai_engine.py::test_the_agent_sends_the_configured_sampling_to_the_server",
        ],
    ),
    "codeloop/engine/sampler.py": (
        [
            "sample",
            "_sample_alike",
            "_sample_rows",
            "uniforms",
            "_mix32",
            "_times32",
            "_invert_cdf",
            "_most_likely",
        ],
        [
            "tests/engine/test_hf_engine.py::test_draws_are_a_hash_of_seed_and_counter",
            "tests/engine/test_hf_engine.py::test_sampling_follows_temperature_and_top_p",
            "tests/engine/test_hf_engine.py::test_a_draw_picks_where_the_cdf_passes_it",
            "tests/engine/test_hf_engine.py::"
            "test_top_p_reaches_past_the_64_most_likely_tokens_of_a_flat_distribution",
            "tests/engine/test_hf_engine.py::test_top_p_keeps_the_most_likely_token",
            "tests/engine/test_hf_engine.py::test_seeded_sampling_does_not_depend_on_the_batch",
            "tests/engine/test_hf_engine.py::"
            "test_a_batch_of_one_setting_samples_what_rows_of_their_own_settings_sample",
        ],
    ),
    "codeloop/engine/stops.py": (
        ["finish_reason", "may_complete", "completing_ids"],
        [
            "tests/engine/test_hf_engine.py::test_a_row_stops_at_max_tokens_and_not_before",
            "tests/engine/test_hf_engine.py::test_stop_strings_and_end_of_turn_tokens",
            "tests/rollout/test_real_tokenizer.py::"
            "test_the_tail_is_decoded_only_after_a_token_that_can_complete_a_stop_string",
        ],
    ),
    "codeloop/engine/scheduler.py": (
        ["generate", "_take", "_leave_out", "_check_any_hope", "_place"],
        ["tests/engine/test_scheduler.py"],
    ),
    "codeloop/trainer/learner.py": (
        ["update", "_update", "__init__", "_recompute_old_logprobs"],
        ["tests/trainer/test_learner.py", "tests/trainer/test_rl.py"],
    ),
    "codeloop/sandbox/zygote.py": (["_status_from"], ["tests/sandbox/test_status.py"]),
    "codeloop/trainer/groups.py": (
        ["groups", "_next_problems", "problem_at", "samples_of"],
        [
            "tests/trainer/test_group_source.py",  # one process; below, two ranks under torchrun
            "tests/trainer/test_distributed.py::"
            "test_dropping_zero_signal_groups_with_two_ranks_keeps_what_one_process_keeps",
        ],
    ),
}
# Modules whose guarding tests include slow ones (named above by node id): run them too.
SLOW_GUARDS = {"codeloop/trainer/groups.py"}
# Mutants that change no behaviour a caller can see (equivalent mutants), each with the reason:
# (module, function, mutation, text on its line (with a newline: on it and the line before),
# text where the mutated code starts (with a final `$`: all the rest of the line)) -> why.
EQUIVALENT: dict[tuple[str, str, str, str, str], str] = {
    (
        "codeloop/algo/loss.py",
        "policy_loss",
        "0 -> 1",
        "if dual_clip > 0",
        "0",
    ): "the config refuses a dual clip in (0, 1]: c = 0 (off) or c > 1",
    (
        "codeloop/algo/loss.py",
        "policy_loss",
        "Lt -> LtE",
        "torch.where(adv < 0",
        "adv",
    ): "at A = 0 both sides are 0",
    (
        "codeloop/algo/loss.py",
        "sequence_loss",
        "0 -> 1",
        "if dual_clip > 0",
        "0",
    ): "the config refuses a dual clip in (0, 1]: c = 0 (off) or c > 1",
    (
        "codeloop/algo/loss.py",
        "sequence_loss",
        "Lt -> LtE",
        "torch.where(adv < 0",
        "adv",
    ): "at A = 0 both sides are 0",
    (
        "codeloop/algo/loss.py",
        "behaviour_weights",
        "True -> False",
        "strict=True",
        "True",
    ): "the three lists have one entry per token: strict only checks it",
    (
        "codeloop/algo/resample.py",
        "_split_released",
        "LtE -> Lt",
        "if neg <= min(",
        "neg",
    ): "at equality the branch assigns the value neg already has",
    (
        "codeloop/algo/resample.py",
        "_split_released",
        "LtE -> Lt",
        "if pos <= min(",
        "pos",
    ): "at equality the branch assigns the value pos already has",
    (
        "codeloop/algo/resample.py",
        "resample",
        "1.0 -> 2.0",
        "weights = [1.0 /",
        "1.0",
    ): "scaling every weight alike leaves the weighted draw unchanged",
    (
        "codeloop/reward/extract.py",
        "_braced",
        "Add -> Sub",
        "return text[start + 1 : i], i + 1",
        "i + 1",
    ): "the search for the next box resumes inside the closing braces, where none starts",
    (
        "codeloop/reward/extract.py",
        "all_boxed",
        "LtE -> Lt",
        "<= 1:  # the common case",
        "text",
    ): "a single box on the general path gives what the fast path gives",
    (
        "codeloop/reward/extract.py",
        "_final_answer_block",
        "Lt -> LtE",
        "if end < 0",
        "end",
    ): "</answer> is searched after <answer>: found, it is never at 0",
    (
        "codeloop/reward/extract.py",
        "_final_answer_block",
        "0 -> 1",
        "if end < 0",
        "0",
    ): "</answer> is searched after <answer>: found, it is never at 0",
    (
        "codeloop/reward/integer.py",
        "_normalise",
        "0 -> 1",
        "range(3 if",
        "0)",
    ): "wrappers are backslash commands: without a backslash a pass removes nothing",
    (
        "codeloop/reward/integer.py",
        "_normalise",
        "3 -> 4",
        "range(3 if",
        "3 if",
    ): "a fourth pass unwraps a fourth level of nesting, which answers do not have: the "
    "limit only bounds the work",
    (
        "codeloop/reward/integer.py",
        "parse_number",
        "1 -> 2",
        "if not text[:1].isdigit()",
        "1",
    ): "the gate only skips a currency substitution that cannot match (a currency sign "
    "starts with no digit or ends with no letter or digit): two characters gate the same",
    (
        "codeloop/reward/symbolic.py",
        "_equivalent",
        "Or -> And",
        "if pred_form == gold_form or",
        "pred_form == gold_form",
    ): "math-verify finds identical forms and words that differ in "
    "case equal too: the line saves its time, not its verdict",
    (
        "codeloop/reward/symbolic.py",
        "_expand_plus_minus",
        "In -> NotIn",
        "minus_first =",
        "match.group",
    ): "the two expansions are compared as a set: their order does not matter",
    (
        "codeloop/reward/symbolic.py",
        "_parsed",
        "0 -> 1",
        "boxed_match_priority=0",
        "0",
    ): "the answers parsed here carry no \\boxed (extraction took it off): no box to rank",
    (
        "codeloop/reward/symbolic.py",
        "_equivalent",
        "Or -> And",
        "if not pred_form or not gold_form",
        "not pred_form",
    ): "an empty side then parses to nothing and the check below says False",
    (
        "codeloop/reward/symbolic.py",
        "_equivalent",
        "Or -> And",
        "if not gold_parsed or not pred_",
        "not gold_parsed",
    ): "verify over an empty parse is False",
    (
        "codeloop/reward/symbolic.py",
        "_equivalent",
        "False -> True",
        "if not gold_parsed or not pred_parsed:\n        return False",
        "False$",
    ): "unreached: both forms are non-empty here and math-verify's parse of a non-empty answer "
    "holds at least the answer's own text",
    (
        "codeloop/reward/fastpath.py",
        "fast_check",
        "condition negated",
        "if other is None:",
        "if",
    ): "no pair is known whose own reading is decided False while another one is undecided: "
    "the other readings are plain numbers wherever the pair's own is decided",
    (
        "codeloop/reward/fastpath.py",
        "fast_check",
        "Is -> IsNot",
        "if other is None:",
        "other",
    ): "the other readings are then decided too: the mutant only sends a pair the fast path "
    "found wrong on to the workers, which find it wrong as well (slower, same verdict)",
    (
        "codeloop/reward/verifier.py",
        "score_async",
        "condition negated",
        "if self._thread is None",
        "if",
    ): "without its own thread the loop's default executor runs the check; the pool "
    "serialises checks under its lock: the same results",
    (
        "codeloop/reward/verifier.py",
        "score_async",
        "Is -> IsNot",
        "if self._thread is None",
        "self._thread",
    ): "as above: a new thread per call, the same results",
    (
        "codeloop/reward/verifier.py",
        "score_async",
        "1 -> 2",
        "ThreadPoolExecutor(1,",
        "1",
    ): "two threads: the pool serialises checks under its lock, the same results",
    (
        "codeloop/reward/verifier.py",
        "score_batch",
        "True -> False",
        "strict=True",
        "True",
    ): "the pool answers one check per pair: the lengths are equal; strict only checks it",
    (
        "codeloop/reward/verifier.py",
        "close",
        "True -> False",
        "shutdown(wait=True)",
        "True",
    ): "close comes after every score_async was awaited: nothing is left to wait for",
    (
        "codeloop/rollout/agent.py",
        "run_trajectory",
        "Lt -> LtE",
        "while turns < cfg.max_turns",
        "turns",
    ): "the loop leaves by `turns == max_turns` first; max_turns >= 1 (config)",
    (
        "codeloop/rollout/agent.py",
        "run_trajectory",
        "LtE -> Lt",
        "if budget <= 0",
        "budget",
    ): "the budget is at least 1 here: a turn that used it up ended the loop (length), and an "
    "observation goes in only with a token left after it",
    (
        "codeloop/rollout/agent.py",
        "add",
        "1 -> 2",
        "[-1] * len(ids)",
        "1",
    ): "a negative version means unknown (Trajectory.policy_versions): -1 and -2 read alike",
    (
        "codeloop/rollout/agent.py",
        "_has_answer",
        "GtE -> Gt",
        'find("</answer>", start) >= 0',
        "turn_text.find",
    ): "</answer> is found after <answer>, never at 0",
    (
        "codeloop/rollout/agent.py",
        "_has_answer",
        "0 -> 1",
        'find("</answer>", start) >= 0',
        "0$",
    ): "</answer> is found after <answer>, never at 0",
    (
        "codeloop/trainer/learner.py",
        "__init__",
        "0 -> 1",
        "pad_id: int = 0",
        "0",
    ): "the pad id fills positions the attention and loss masks leave out",
    (
        "codeloop/trainer/learner.py",
        "_update",
        "Mult -> Div",
        "(loss * weight * world.size)",
        "loss",
    ): "in one process weight and world.size are 1; FSDP's padding micro-batches "
    "(weight 0) and several ranks: the two-process tests (slow) run them",
    (
        "codeloop/trainer/learner.py",
        "_update",
        "Mult -> Div",
        "sums[key] += value * weight",
        "value",
    ): "in one process weight is 1; the two-process tests (slow) run weight 0",
    (
        "codeloop/trainer/learner.py",
        "_update",
        "True -> False",
        "zero_grad(set_to_none=True)",
        "True",
    ): "gradients zeroed or set to None: the next backward starts from nothing either way",
    (
        "codeloop/trainer/learner.py",
        "_update",
        "True -> False",
        "for sample, engine in zip(samples, behaviour, strict=True)",
        "True",
    ): "one behaviour list per sample: strict only checks it",
    (
        "codeloop/trainer/learner.py",
        "_recompute_old_logprobs",
        "1 -> 2",
        'batch["input_ids"][:1, :1]',
        "1",
    ): "a padding forward for FSDP (several ranks): its output is not used",
    (
        "codeloop/trainer/learner.py",
        "_recompute_old_logprobs",
        "0.0 -> 1.0",
        "sample.old_logprobs = [0.0] +",
        "0.0",
    ): "position 0 is a prompt token, never in the loss",
    (
        "codeloop/trainer/learner.py",
        "_recompute_old_logprobs",
        "0.0 -> 1.0",
        "v if m else 0.0",
        "0.0",
    ): "a position outside the loss mask is never in the loss",
    (
        "codeloop/trainer/learner.py",
        "_recompute_old_logprobs",
        "True -> False",
        "strict=True",
        "True",
    ): "the two lengths are equal; strict only checks it",
    (
        "codeloop/engine/sampler.py",
        "sample",
        "True -> False",
        "non_blocking=True",
        "True",
    ): "a blocking copy moves the same draws",
    (
        "codeloop/engine/sampler.py",
        "sample",
        "LtE -> Lt",
        "probs.cumsum(-1) - probs <=",
        "probs",
    ): "differs only where a float cumulative probability equals top-p exactly",
    (
        "codeloop/engine/sampler.py",
        "_most_likely",
        "64 -> 65",
        "for k in (64, 1024)",
        "64",
    ): "how many tokens are tried before a full sort: speed, not the tokens",
    (
        "codeloop/engine/sampler.py",
        "_most_likely",
        "1024 -> 1025",
        "for k in (64, 1024)",
        "1024",
    ): "how many tokens are tried before a full sort: speed, not the tokens",
    (
        "codeloop/engine/sampler.py",
        "_most_likely",
        "Lt -> LtE",
        "if k < vocab",
        "k",
    ): "top-k of the whole vocabulary is the full sort",
    (
        "codeloop/engine/sampler.py",
        "_most_likely",
        "1 -> 2",
        "vocab = logprobs.shape[-1]",
        "1",
    ): "the rows' count only changes which cuts are tried, each still over the vocabulary",
    (
        "codeloop/engine/sampler.py",
        "_most_likely",
        "Gt -> GtE",
        "top.exp().sum(-1) > top_p",
        "top",
    ): "differs only where a float mass equals top-p exactly",
    (
        "codeloop/engine/sampler.py",
        "_invert_cdf",
        "Sub -> Add",
        "clamp(max=probs.shape[-1] - 1)",
        "probs.shape[-1] - 1",
    ): "a draw below 1 times a float32 total stays below it: the clamp never binds",
    (
        "codeloop/engine/sampler.py",
        "_invert_cdf",
        "True -> False",
        "right=True",
        "True",
    ): "differs only where a draw times the total equals a float cumulative sum exactly",
    (
        "codeloop/engine/sampler.py",
        "_most_likely",
        "1 -> 2",
        "top.exp().sum(-1) > top_p",
        "1",
    ): "summing the wrong axis only falls through to the full sort: speed, not the tokens",
    (
        "codeloop/engine/stops.py",
        "may_complete",
        "LtE -> Lt",
        "not 0 <= token",
        "0",
    ): "token 0 would only be decoded more often (the check stays the same)",
    (
        "codeloop/engine/stops.py",
        "may_complete",
        "0 -> 1",
        "not 0 <= token",
        "0",
    ): "token 0 would only be decoded more often (the check stays the same)",
    (
        "codeloop/trainer/groups.py",
        "samples_of",
        "True -> False",
        "strict=True",
        "True",
    ): "a group has one advantage per kept trajectory; strict only checks it",
    (
        "codeloop/trainer/groups.py",
        "groups",
        "GtE -> Gt",
        "if len(groups) >= count",
        "len",
    ): "at equality the rounds left draw count - len(groups) = 0 problems: the same groups",
    (
        "codeloop/engine/scheduler.py",
        "generate",
        "GtE -> Gt",
        "if scheduler._now() >= give_up",
        "scheduler",
    ): "the loop's clock equal to the deadline to the nanosecond: one retry more",
    (
        "codeloop/engine/scheduler.py",
        "_check_any_hope",
        "LtE -> Lt",
        "s.failing_since + self.retry_s <= now",
        "s.failing_since",
    ): "an outage exactly retry_s old to the nanosecond: one try more before failing at once",
}
PYTEST = ["-x", "-q", "-p", "no:cacheprovider", "--no-header"]

_COMPARE_SWAPS: dict[type, type] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_BINOP_SWAPS: dict[type, type] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
}


@dataclass
class Mutant:
    module: str
    function: str
    line: int
    what: str
    source: str
    text: str = ""  # the original line
    at: str = ""  # the original line from where the mutated code starts
    before: str = ""  # the line before it

    def equivalent(self) -> str:
        """Why this mutant is harmless, when EQUIVALENT names it; else ''."""
        for (module, function, what, line, at), why in EQUIVALENT.items():
            same = (module, function, what) == (self.module, self.function, self.what)
            here = self.at.rstrip() == at[:-1] if at.endswith("$") else self.at.startswith(at)
            lines = f"{self.before.strip()}\n{self.text}" if "\n" in line else self.text
            wanted = "\n".join(part.strip() for part in line.split("\n"))
            if same and wanted in lines and here:
                return why
        return ""


def _docstring_ids(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            found.add(id(first.value))
    return found


def _edits(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """(description, replacement node) for each small bug planted at `node`."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _COMPARE_SWAPS:
                new = copy.deepcopy(node)
                new.ops[i] = _COMPARE_SWAPS[type(op)]()
                yield f"{type(op).__name__} -> {type(new.ops[i]).__name__}", new
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAPS:
        new = copy.deepcopy(node)
        new.op = _BINOP_SWAPS[type(node.op)]()
        yield f"{type(node.op).__name__} -> {type(new.op).__name__}", new
    elif isinstance(node, ast.AugAssign) and type(node.op) in _BINOP_SWAPS:
        new = copy.deepcopy(node)
        new.op = _BINOP_SWAPS[type(node.op)]()
        yield f"{type(node.op).__name__}= -> {type(new.op).__name__}=", new
    elif isinstance(node, ast.BoolOp):
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield f"{type(node.op).__name__} -> {type(new.op).__name__}", new
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield "not x -> x", node.operand
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float, bool):
        value = node.value
        if isinstance(value, bool):
            yield f"{value} -> {not value}", ast.Constant(not value)
        elif isinstance(value, int):
            yield f"{value} -> {value + 1}", ast.Constant(value + 1)
        else:
            changed = value * 2 if value else 1.0
            yield f"{value} -> {changed}", ast.Constant(changed)
    elif isinstance(node, ast.If | ast.While):
        new = copy.deepcopy(node)
        new.test = ast.UnaryOp(ast.Not(), node.test)
        yield "condition negated", new
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        swap = {"min": "max", "max": "min", "any": "all", "all": "any"}.get(node.func.id)
        if swap:
            new = copy.deepcopy(node)
            new.func = ast.Name(swap, ast.Load())
            yield f"{node.func.id}() -> {swap}()", new


class _Replace(ast.NodeTransformer):
    def __init__(self, target: ast.AST, replacement: ast.AST):
        self.target, self.replacement = target, replacement

    def visit(self, node: ast.AST) -> ast.AST:
        if node is self.target:
            return self.replacement
        return super().visit(node)


def mutants(module: str, functions: list[str] | None) -> Iterator[Mutant]:
    """Every mutant of `module` (inside `functions`, or every function), one bug each."""
    text = (ROOT / module).read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    skip = _docstring_ids(tree)
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if functions is not None and function.name not in functions:
            continue
        for node in ast.walk(function):
            if id(node) in skip or node is function:
                continue
            line = getattr(node, "lineno", 0)
            if line and "pragma: no mutate" in lines[line - 1]:
                continue
            if isinstance(node, ast.If | ast.While) and isinstance(node.test, ast.UnaryOp):
                continue  # its `not` is removed as a mutant of its own
            for what, replacement in _edits(node):
                fresh = ast.parse(text)  # the original tree stays as it is
                twin = next(
                    other
                    for other in ast.walk(fresh)
                    if type(other) is type(node) and _where(other) == _where(node)
                )
                # a copy: a replacement may be a node of the original tree (`not x` -> `x`),
                # whose own location must stay for its mutants
                placed = ast.copy_location(copy.deepcopy(replacement), node)
                mutated = _Replace(twin, placed).visit(fresh)
                yield Mutant(
                    module,
                    function.name,
                    line,
                    what,
                    ast.unparse(ast.fix_missing_locations(mutated)),
                    lines[line - 1].strip() if line else "",
                    lines[line - 1][node.col_offset :] if line else "",
                    lines[line - 2] if line > 1 else "",
                )


def _where(node: ast.AST) -> tuple[int, int, int, int]:
    return (
        getattr(node, "lineno", -1),
        getattr(node, "col_offset", -1),
        getattr(node, "end_lineno", -1),
        getattr(node, "end_col_offset", -1),
    )


def _run_tests(copy_root: Path, tests: list[str], timeout_s: float, slow: bool = False) -> str:
    """'killed', 'survived' or 'timeout': pytest over `tests` (`slow` ones too) in a forked
    child."""
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(copy_root)
            sys.path.insert(0, str(copy_root))
            sys.path.insert(0, str(copy_root / "tests"))
            # the same for the Python processes a test starts (torchrun workers, the CLI)
            os.environ["PYTHONPATH"] = os.pathsep.join([str(copy_root), str(copy_root / "tests")])
            os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            import pytest

            marks = "not gpu" if slow else "not slow and not gpu"
            code = pytest.main([*PYTEST, "-m", marks, *tests])
        except BaseException:  # noqa: BLE001 - a mutant that breaks the import is killed
            code = 1
        os._exit(int(code))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "survived" if os.waitstatus_to_exitcode(status) == 0 else "killed"
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "timeout"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="modules whose path contains this (repeatable; default: all)",
    )
    parser.add_argument("--out", default="", help="also write the report here (Markdown)")
    args = parser.parse_args()
    sys.dont_write_bytecode = True
    import numpy  # noqa: F401  - the heavy libraries, imported once before the forks
    import pytest  # noqa: F401
    import sympy  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    work = Path(tempfile.mkdtemp(prefix="codeloop-mutate-"))
    try:
        for part in ("codeloop", "tests", "pyproject.toml"):
            source = ROOT / part
            if source.is_dir():
                shutil.copytree(source, work / part, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(source, work / part)
        rows: list[tuple[str, int, int, int, int]] = []
        survivors: list[Mutant] = []
        for module, (functions, tests) in TARGETS.items():
            if args.only and not any(part in module for part in args.only):
                continue
            started = time.monotonic()
            slow = module in SLOW_GUARDS
            if _run_tests(work, tests, 1800, slow) != "survived":
                print(f"{module}: its tests fail without any mutant; skipped", flush=True)
                continue
            limit = 3 * (time.monotonic() - started) + 10
            original = (work / module).read_text()
            counts = {"killed": 0, "survived": 0, "timeout": 0, "equivalent": 0}
            for mutant in mutants(module, functions):
                (work / module).write_text(mutant.source)
                outcome = _run_tests(work, tests, limit, slow)
                if outcome == "survived" and mutant.equivalent():
                    outcome = "equivalent"
                counts[outcome] += 1
                if outcome in ("survived", "equivalent"):
                    survivors.append(mutant)
                    print(
                        f"  {outcome} {module}:{mutant.line} {mutant.function}: {mutant.what}",
                        flush=True,
                    )
            (work / module).write_text(original)
            rows.append(
                (
                    module,
                    sum(counts.values()),
                    counts["killed"] + counts["timeout"],
                    counts["equivalent"],
                    counts["survived"],
                )
            )
            print(
                f"{module}: {rows[-1][1]} mutants, {counts['killed']} killed, "
                f"{counts['timeout']} timed out, {counts['equivalent']} equivalent, "
                f"{counts['survived']} survived",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = _report(rows, survivors)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


def _report(rows: list[tuple[str, int, int, int, int]], survivors: list[Mutant]) -> str:
    lines = ["| module | mutants | killed | equivalent | survived |", "|---|---:|---:|---:|---:|"]
    lines += [f"| `{m}` | {n} | {k} | {e} | {s} |" for m, n, k, e, s in rows]
    total = [sum(r[i] for r in rows) for i in (1, 2, 3, 4)]
    lines.append(f"| all | {total[0]} | {total[1]} | {total[2]} | {total[3]} |")
    for title, chosen in (
        ("Equivalent (harmless)", [s for s in survivors if s.equivalent()]),
        ("Survivors", [s for s in survivors if not s.equivalent()]),
    ):
        if chosen:
            lines += ["", f"{title}:", ""]
            for s in chosen:
                why = f": {s.equivalent()}" if s.equivalent() else ""
                where = f"`{s.module}:{s.line}` in `{s.function}`"
                lines.append(f"- {where}: {s.what} (`{s.text}`){why}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
