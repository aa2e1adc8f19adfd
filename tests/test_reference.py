"""The generated reference pages: current in docs/, and complete."""

from pathlib import Path

import pytest

from codeloop import reference
from codeloop.cli import build_parser, main

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return reference.pages(main, build_parser())


def test_the_pages_in_docs_are_what_the_code_generates(pages: dict[str, str]) -> None:
    for name, text in pages.items():
        assert (DOCS / name).read_text() == text, f"docs/{name} is out of date: run codeloop docs"


def test_every_config_key_has_a_row_with_its_default(pages: dict[str, str]) -> None:
    page = pages["configuration.md"]
    assert "| `rollout.engine_max_batch` | an integer | `64` |" in page
    assert "| `algo.clip_high` | a number | `0.28` |" in page  # the report's clip-higher
    assert "### [[recipe.stages]]" in page and "| `refilter_samples` |" in page


def test_every_command_has_its_help(pages: dict[str, str]) -> None:
    page = pages["cli.md"]
    for command in (
        "## codeloop real",
        "## codeloop bench rollout",
        "## codeloop data stats",
        "## codeloop config show",
        "## codeloop docs",
    ):
        assert command + "\n" in page
    assert "--random-weights" in page and "--gpu" in page  # options of sub-parsers of their own


def test_check_names_the_stale_pages(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    pages: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        reference, "pages", lambda cli, parser: pages
    )  # generated once for the module
    assert reference.main(str(tmp_path), True, main, build_parser()) == 1
    assert "configuration.md" in capsys.readouterr().out
    assert reference.main(str(tmp_path), False, main, build_parser()) == 0
    assert reference.main(str(tmp_path), True, main, build_parser()) == 0


def test_every_relative_link_of_the_readme_and_docs_exists() -> None:
    import re

    root = DOCS.parent
    pages = [root / "README.md", root / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(root)} -> {target}")
    assert broken == []


def test_every_option_has_help_and_says_its_default() -> None:
    import argparse

    from codeloop.cli import build_parser

    missing = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                shown = parser.formatter_class(path)._get_help_string(action) or ""  # type: ignore[attr-defined]
                says = action.default in (None, False, "", []) or "default" in shown
                if not action.help or not says:
                    missing.append(f"{path} {action.option_strings or action.dest}")

    walk(build_parser(), "codeloop")
    assert missing == []
