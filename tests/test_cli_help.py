"""A newcomer finds every command's options in `--help` and the README (issue 45).

Every option of every `hetpar` command says what it does, every command has a
description, and the README's command table lists every command.
"""

import argparse
import pathlib

import pytest

from hetpar.cli import _COMMANDS, _parser

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_command_is_registered():
    assert list(commands()) == list(_COMMANDS)


@pytest.mark.parametrize("name", _COMMANDS)
def test_every_option_says_what_it_does(name):
    parser = commands()[name]
    assert parser.description, f"hetpar {name} --help has no description"
    bare = [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions
            if not a.help and a.dest != "help"]
    assert not bare, f"hetpar {name}: options without help: {bare}"


def test_the_readme_lists_every_command():
    text = README.read_text()
    table = text[text.index("## Command line"):]
    table = table[:table.index("\n## ", 1)]
    missing = [name for name in _COMMANDS if f"| `hetpar {name}" not in table]
    assert not missing, f"README's command table lacks {missing}"
