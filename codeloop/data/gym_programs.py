"""Programs that compute a reasoning-gym problem's answer the way its task asks.

One small generator a task family (`PROGRAMS`): it reads the problem's own data (the metadata
its generator wrote, the numbers and words its question shows) and returns the short Python
program a careful solver would write: `math.gcd(780, 461)`, `bin(n).count("1")`, `int("115",
11)` and a loop of `divmod`, `sorted(...)`, `datetime` arithmetic, ... Nothing is worked out
ahead: the program holds only what the question states (and, for `leg_counting`, the legs of
each animal named, which the model has to know) and prints the answer, in the form the task's
scorer reads. `program(task, metadata, question)` is None for a family without a generator.

These are the non-reasoning SFT demonstrations of the gym recipe (`recipe/demos.py`): each
program runs in the sandbox, and a problem becomes a conversation only when what it prints is
scored right by its task's own scorer. A family enters as one function here; which families
have demonstrations in a run is data (`families.json`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Metadata = dict[str, Any]
Generator = Callable[[Metadata, str], str]


def _expression(m: Metadata, question: str) -> str:
    if "/" not in m["expression"]:
        return f"print({m['expression']})"
    return f"x = {m['expression']}\nprint(int(x) if x == int(x) else x)"


def _last_line_expression(m: Metadata, question: str) -> str:
    """decimal_arithmetic: the expression is the question's last line, before `= ?`."""
    line = [x for x in question.strip().splitlines() if x.strip()][-1]
    return f"print({line.split('=')[0].strip()})"


def _decimal_sum(m: Metadata, question: str) -> str:
    terms = m["expression"].split()
    literal = " ".join(t if t in "+-" else f'Decimal("{t}")' for t in terms)
    return f"from decimal import Decimal\nprint({literal})"


def _gcd(m: Metadata, question: str) -> str:
    return f"import math\nprint(math.gcd({', '.join(map(str, m['numbers']))}))"


def _lcm(m: Metadata, question: str) -> str:
    return f"import math\nprint(math.lcm({', '.join(map(str, m['numbers']))}))"


def _count_bits(m: Metadata, question: str) -> str:
    return f'print(bin({m["number"]}).count("1"))'


def _count_primes(m: Metadata, question: str) -> str:
    return (
        "def is_prime(n):\n"
        "    if n < 2:\n"
        "        return False\n"
        "    return all(n % d for d in range(2, int(n ** 0.5) + 1))\n"
        f"print(sum(is_prime(n) for n in range({m['start']}, {m['end']} + 1)))"
    )


def _base_conversion(m: Metadata, question: str) -> str:
    return (
        f'n = int("{m["source_repr"]}", {m["source_base"]})\n'
        'digits = "0123456789abcdefghijklmnopqrstuvwxyz"\n'
        'out = ""\n'
        "while n > 0:\n"
        f"    n, d = divmod(n, {m['target_base']})\n"
        "    out = digits[d] + out\n"
        'print(out or "0")'
    )


def _leg_counting(m: Metadata, question: str) -> str:
    from reasoning_gym.arithmetic.leg_counting import ANIMALS

    legs = {animal: ANIMALS[animal] for animal in m["animals"]}
    return (
        f"legs = {legs!r}\ncount = {m['animals']!r}\nprint(sum(legs[a] * count[a] for a in count))"
    )


def _fraction(m: Metadata, question: str) -> str:
    return (
        "from fractions import Fraction\n"
        f"f = Fraction({m['numerator']}, {m['denominator']})\n"
        'print(f"{f.numerator}/{f.denominator}")'
    )


def _prime_factorization(m: Metadata, question: str) -> str:
    return (
        f"n = {m['number']}\n"
        "factors = []\n"
        "d = 2\n"
        "while d * d <= n:\n"
        "    while n % d == 0:\n"
        "        factors.append(d)\n"
        "        n //= d\n"
        "    d += 1\n"
        "if n > 1:\n"
        "    factors.append(n)\n"
        'print(" × ".join(map(str, factors)))'
    )


def _simple_equation(m: Metadata, question: str) -> str:
    left, right = (side.strip() for side in m["equation"].split("="))
    x = m["variable"]
    return (
        "from fractions import Fraction\n"
        f"def f({x}):\n"
        f"    return ({left}) - ({right})\n"
        "a = f(Fraction(0))\n"
        "b = f(Fraction(1)) - a\n"
        "print(-a / b)"
    )


def _power(m: Metadata, question: str) -> str:
    return f'print(f"{{({m["base"]}) ** {m["exponent"]}:.3e}}")'


def _time_interval(m: Metadata, question: str) -> str:
    start, end = _times(question)
    if m["task_type"] == "date":
        body = 'print(f"{d.days} days")'
    elif m["task_type"].startswith("time"):
        seconds = "int(d.total_seconds())"
        if m["expected_format"] == "HH:MM":
            body = f's = {seconds}\nprint(f"{{s // 3600:02d}}:{{s % 3600 // 60:02d}}")'
        elif m["expected_format"] == "HH:MM:SS":
            body = (
                f's = {seconds}\nprint(f"{{s // 3600:02d}}:{{s % 3600 // 60:02d}}:{{s % 60:02d}}")'
            )
        else:
            body = (
                "ms = round(d.total_seconds() * 1000)\n"
                "s, ms = divmod(ms, 1000)\n"
                'print(f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}.{ms:03d}")'
            )
    else:
        clock = "{h:02d}:{mi:02d}" + (":{s:02d}" if m["expected_format"].endswith("SS") else "")
        body = (
            "h, rest = divmod(d.seconds, 3600)\n"
            "mi, s = divmod(rest, 60)\n"
            f'print(f"{{d.days}} days, {clock}")'
        )
    return (
        "from dateutil import parser\n"
        f"start = parser.parse({start!r})\n"
        f"end = parser.parse({end!r})\n"
        "d = end - start\n"
        f"{body}"
    )


def _times(question: str) -> tuple[str, str]:
    """The start and end as the question shows them (matched against the task's own question
    templates), without a weekday in parentheses (dateutil reads the rest)."""
    from reasoning_gym.arithmetic.time_intervals import TimeIntervalsDataset

    for template in TimeIntervalsDataset.TEMPLATES:
        pattern = re.escape(template)
        for name in ("start", "end", "format"):
            pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>.+?)")
        if found := re.fullmatch(pattern, question.strip()):
            start, end = found["start"], found["end"]
            return start.split(" (")[0], end.split(" (")[0]
    raise ValueError(f"time_intervals: a question no template matches: {question!r}")


def _letter_count(m: Metadata, question: str) -> str:
    text = " ".join(m["span"])
    return f'print({text!r}.lower().count("{m["target_letter"]}"))'


def _number_sorting(m: Metadata, question: str) -> str:
    reverse = m["direction"] == "descending"
    return (
        f"numbers = {m['original_numbers']!r}\n"
        f"print(sorted(numbers, key=float{', reverse=True' if reverse else ''}))"
    )


def _word_sorting(m: Metadata, question: str) -> str:
    reverse = m["direction"] == "descending"
    return (
        f"words = {m['transformed_words']!r}\n"
        f'print(", ".join(sorted(words{", reverse=True" if reverse else ""})))'
    )


def _spell_backward(m: Metadata, question: str) -> str:
    return f"print({m['word']!r}[::-1])"


def _word_reversal(m: Metadata, question: str) -> str:
    return f'words = {m["words"]!r}\nprint(", ".join(reversed(words)))'


def _bitwise(m: Metadata, question: str) -> str:
    return f"print(hex({m['problem']}))"


PROGRAMS: dict[str, Generator] = {
    "base_conversion": _base_conversion,
    "basic_arithmetic": _expression,
    "bitwise_arithmetic": _bitwise,
    "chain_sum": _expression,
    "count_bits": _count_bits,
    "count_primes": _count_primes,
    "decimal_arithmetic": _last_line_expression,
    "decimal_chain_sum": _decimal_sum,
    "fraction_simplification": _fraction,
    "gcd": _gcd,
    "lcm": _lcm,
    "leg_counting": _leg_counting,
    "letter_counting": _letter_count,
    "number_sorting": _number_sorting,
    "power_function": _power,
    "prime_factorization": _prime_factorization,
    "products": _expression,
    "simple_equations": _simple_equation,
    "spell_backward": _spell_backward,
    "time_intervals": _time_interval,
    "word_sequence_reversal": _word_reversal,
    "word_sorting": _word_sorting,
}


def program(task: str, metadata: Metadata, question: str) -> str | None:
    """The program computing this problem's answer, or None when `task` has no generator."""
    generator = PROGRAMS.get(task)
    return None if generator is None else generator(metadata, question)
