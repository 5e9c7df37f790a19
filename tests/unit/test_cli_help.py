"""Every flag and argument of every subcommand has a help text (a user reads `--help`, not the source)."""
from __future__ import annotations

import argparse

from ulfmtrain.cli import build_parser


def _without_help(parser: argparse.ArgumentParser, path: str) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += _without_help(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction) and not (action.help or "").strip():
            missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_flag_of_every_subcommand_has_help() -> None:
    assert _without_help(build_parser(), "ulfmtrain") == []


def test_the_walk_sees_a_flag_without_help() -> None:
    parser = argparse.ArgumentParser()
    parser.add_subparsers().add_parser("x").add_argument("--bare")
    assert _without_help(parser, "p") == ["p x --bare"]
