"""Reading and writing hetpar's JSON files (graph.json, plan.json, profiles).

One place that turns a missing file, bad JSON or a malformed field into an
error that names the file and says how to make a good one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, TypeVar

from hetpar.core._errors import HetparError

T = TypeVar("T")


def load_json(path: str | os.PathLike, from_json: Callable[[Any], T],
              error: type[HetparError], *, what: str, how: str) -> T:
    """Reads `path` and builds an object from it with `from_json`.

    Args:
      path: the file.
      from_json: builds the object from the parsed JSON, raising `error` when malformed.
      error: the HetparError subclass to raise.
      what: what the file is, for messages (`graph file`).
      how: how to write a good one, for the missing-file message (`hetpar costs --out`).

    Raises:
      error: the file is missing, not JSON, or malformed; the message names the file.
    """
    where = os.fspath(path)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise error(f"no {what} at {where!r}; write one with `{how}`") from None
    except IsADirectoryError:
        raise error(f"{where!r} is a directory, not a {what}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{where!r} is not valid JSON: {e}") from None
    try:
        return from_json(data)
    except error as e:
        raise e.within(where) from None


def save_json(path: str | os.PathLike, data: Any) -> None:
    """Writes `data` as indented JSON, atomically: a crash never leaves half a file."""
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
