"""Write math-verify's own test cases into `codeloop/reward/math_verify_suite.json`.

    python tests/reward/import_math_verify_suite.py PATH/TO/Math-Verify [--out FILE]

PATH is a checkout (a work tree or a bare git directory) of huggingface/Math-Verify at the
pinned commit below. Every `(gold, pred, expected)` case of the parametrised verification tests
under `tests/` is kept with the options its test passes to math-verify (extraction targets,
rounding, strictness, set/relation comparison), so that both verifiers can be run on it as its
authors meant. `test_string_extraction.py` checks multiple-choice letter extraction, not
verification, and has no gold: it is not imported.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

COMMIT = "5d148cfaaf99214c2e4ffb4bc497ab042c592a7a"
NOTICE = (
    "Cases from the tests of huggingface/Math-Verify (https://github.com/huggingface/Math-Verify), "
    f"commit {COMMIT}. Copyright 2024 The HuggingFace Team. The repository is licensed under "
    "the Apache License, Version 2.0 (https://www.apache.org/licenses/LICENSE-2.0); its "
    "tests/test_all.py carries the MIT licence notice: 'Permission is hereby granted, free of "
    "charge, to any person obtaining a copy of this software and associated documentation "
    'files (the "Software"), to deal in the Software without restriction [...] The above '
    "copyright notice and this permission notice shall be included in all copies or "
    "substantial portions of the Software.' The cases are reproduced unchanged; codeloop adds "
    "the options each test passes."
)
FILES = [
    "tests/test_all.py",
    "tests/test_boxed.py",
    "tests/test_numina_cases.py",
    "tests/test_open_thoughts.py",
    "tests/test_strict.py",
    "tests/test_yujianll.py",
]
# What each test function passes to math-verify besides its parameters: `targets` None means
# `parse`'s defaults (test_yujianll calls parse/verify directly).
LATEX, BOTH = ["latex"], ["latex", "expr"]
OPTIONS: dict[str, dict[str, Any]] = {
    "test_number_extraction": {"targets": ["expr"]},
    "test_simple_fraction_notation": {"targets": BOTH},
    "test_sets_handling": {"targets": BOTH},
    "test_latex_notation": {"targets": LATEX},
    "test_percent_notation": {"targets": BOTH},
    "test_latex_notation_math": {"targets": LATEX},
    "test_relations_math": {"targets": LATEX},
    "test_matrix_extraction": {"targets": LATEX},
    "test_complex_math_expressions": {"targets": BOTH},
    "test_math_extraction_edge_cases": {"targets": BOTH},
    "test_math_extraction_additional_cases": {"targets": BOTH},
    "test_set_rel_assymetry": {"targets": LATEX},
    "test_float_precision": {"targets": BOTH, "precision": 5},
    "test_sqrt_precision": {"targets": BOTH, "precision": 5},
    "test_symbols": {"targets": BOTH, "precision": 5},
    "test_boxed": {"targets": BOTH},
    "test_numina_cases": {"targets": BOTH},
    "test_open_thoughts": {"targets": BOTH},
    "test_strict_variable_comparison": {"targets": BOTH},
    "test_string_extraction": {"targets": None},  # test_yujianll's verify(parse, parse)
}
RESULT_NAMES = {"expected", "result"}


def _source(checkout: Path, path: str) -> str:
    work_tree = checkout / path
    if work_tree.is_file():
        return work_tree.read_text("utf-8")
    shown = subprocess.run(
        ["git", "--git-dir", str(checkout), "show", f"{COMMIT}:{path}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return shown.stdout


def _cases(path: str, source: str) -> list[dict[str, Any]]:
    cases = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef) or node.name not in OPTIONS:
            continue
        for decorator in node.decorator_list:
            if not (
                isinstance(decorator, ast.Call)
                and ast.unparse(decorator.func).endswith("parametrize")
            ):
                continue
            names = [n.strip() for n in ast.literal_eval(decorator.args[0]).split(",")]
            # The lists are literals except one f-string of math.sqrt(17): evaluated with math.
            rows = eval(compile(ast.Expression(decorator.args[1]), path, "eval"), {"math": math})
            for index, row in enumerate(rows):
                values = dict(zip(names, row, strict=True))
                options = dict(OPTIONS[node.name])
                for name in ("precision", "strict", "allow_set_relation_comp"):
                    if name in values:
                        options[name] = values[name]
                expected = next(values[n] for n in RESULT_NAMES if n in values)
                cases.append(
                    {
                        "id": f"{Path(path).name}::{node.name}[{index}]",
                        "gold": values["gold"],
                        "pred": values["pred"],
                        "expected": bool(expected),
                        **options,
                    }
                )
    return cases


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkout", type=Path, help="a Math-Verify work tree or git directory")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parents[2] / "codeloop" / "reward" / "math_verify_suite.json",
    )
    args = parser.parse_args(argv)
    cases = [case for path in FILES for case in _cases(path, _source(args.checkout, path))]
    document = {"source": "huggingface/Math-Verify", "commit": COMMIT, "notice": NOTICE}
    args.out.write_text(json.dumps({**document, "cases": cases}, indent=1) + "\n", "utf-8")
    print(f"{len(cases)} cases -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
