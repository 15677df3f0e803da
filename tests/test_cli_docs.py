"""docs/cli.md's synopses and option tables are what the parser renders now, and every subcommand has one."""
import argparse
from pathlib import Path

import pytest

from conveyor.cli import parser
from conveyor.cli.docs import main as docs_main, regenerate, render, subcommands

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli.md"


def test_docs_cli_md_is_what_the_parser_renders_now():
    text = PAGE.read_text()
    assert regenerate(text) == text, ("docs/cli.md differs from what the conveyor parser renders: run "
                                      "`python -m conveyor.cli.docs` in the repository root and commit docs/cli.md")


def test_every_subcommand_has_its_section_in_docs_cli_md():
    text = PAGE.read_text()
    for name in subcommands():
        assert f"<!-- cli: {name} -->" in text, (f"docs/cli.md has no part for `conveyor {name}`: add a section "
                                                 f"with the lines <!-- cli: {name} --> and <!-- end cli -->, then run "
                                                 f"`python -m conveyor.cli.docs`")


def test_a_subcommand_renders_its_synopsis_and_every_option_with_its_help():
    top = argparse.ArgumentParser(prog="tool")
    commands = top.add_subparsers(dest="command")
    sub = commands.add_parser("go", prog="tool go", help="go somewhere", description="Go | stay.")
    sub.add_argument("where", nargs="+", metavar="PLACE", help="places <in order>")
    sub.add_argument("--speed", type=int, default=3, help="how fast (default %(default)s)")
    sub.add_argument("--mode", choices=("walk", "run"), required=True, help="how")
    sub.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    group = sub.add_argument_group("extra")
    group.add_argument("--far", action="store_true", help="go far")
    assert render("go", top) == "\n".join([
        "```", "tool go [options] PLACE [PLACE ...]", "```", "", "Go \\| stay.", "",
        "| argument | meaning |", "| --- | --- |",
        "| `PLACE [PLACE ...]` | places &lt;in order&gt; |",
        "| `--speed SPEED` | how fast (default 3) |",
        "| `--mode {walk,run}` | (required) how |",
        "", "*extra*", "",
        "| argument | meaning |", "| --- | --- |",
        "| `--far` | go far |"])
    assert render("commands", top).splitlines()[2] == "| [`conveyor go`](#conveyor-go) | go somewhere |"


def test_every_option_of_train_is_in_the_page():
    text = PAGE.read_text()
    train = subcommands(parser())["train"]
    for action in train._actions:
        for option in action.option_strings:
            if option not in ("-h", "--help"):
                assert f"`{option}" in text


def test_regenerating_rewrites_only_the_marked_parts_and_names_an_unknown_one(tmp_path, capsys):
    page = tmp_path / "cli.md"
    page.write_text("prose stays\n<!-- cli: describe -->\nold text\n<!-- end cli -->\nmore prose\n")
    assert docs_main([str(page), "--check"]) == 1
    assert "run python -m conveyor.cli.docs" in capsys.readouterr().err
    assert docs_main([str(page)]) == 0
    text = page.read_text()
    assert text.startswith("prose stays\n<!-- cli: describe -->\n```\nconveyor describe entry\n```")
    assert text.endswith("<!-- end cli -->\nmore prose\n") and "old text" not in text
    assert docs_main([str(page), "--check"]) == 0
    with pytest.raises(ValueError, match="unknown part 'desribe'"):
        regenerate("<!-- cli: desribe -->\n<!-- end cli -->\n")
