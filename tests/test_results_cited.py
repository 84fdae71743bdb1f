"""Every figure in the results tables of README.md and experiments/README.md is
found in a file its row cites (issue 42).

The convention, for the writer of those tables:

- A results table has a column named `figure` (README.md) or `headline`
  (experiments/README.md). Each of its rows cites the files that hold its
  figures: a markdown link or a backticked path, anywhere in the row, that
  names something under `results/` (relative to the page; a folder stands
  for the text files in it).
- A figure is a number written with a decimal point, or followed by `%`,
  `x` or a unit (`ms`, `s`, `us`, `GB`, `GB/s`, `MB`, `MiB`, `TFLOP/s`, `B`):
  `1.02`, `+5.6%`, `912 ms`, `259x`, `5.04B`. Bare integers (a batch size, M,
  "7 of 8") are counts, not figures, and so is a number after `goal`,
  `within` or `<=` (a threshold).
- A figure is found when a cited file holds a number that rounds to it at
  the figure's precision: as written, or scaled by 100 (a fraction as a
  percentage), by 1000 (seconds as milliseconds), or, for a percentage, as a
  ratio less one (1.056 as +5.6%). Signs are ignored.

No JAX, no device: this reads text.
"""

from __future__ import annotations

import functools
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGES = ("README.md", "experiments/README.md")
FIGURE_COLUMNS = ("figure", "headline")
TEXT_SUFFIXES = {".md", ".txt", ".log", ".json", ".jsonl", ".csv"}

_UNIT = r"(?:%|x(?![A-Za-z])|\s?(?:ms|s|us|GB/s|GB|MB|MiB|GiB|TFLOP/s)(?![A-Za-z])|B(?![A-Za-z]))"
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-+]?)(?P<num>\d+(?:\.\d+)?)(?P<unit>" + _UNIT + r")?")
_THRESHOLD = re.compile(r"(?:goal|within|<=)\s*$")
_FILE_NUMBER = re.compile(r"(\d+(?:\.\d+)?)([eE][-+]?\d+)?")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
_CODE = re.compile(r"`([^`]+)`")


def _cells(line: str) -> list[str]:
    """A table row's cells, split at `|` outside backticks (an escaped `\\|` stays)."""
    cells, cur, code = [], [], False
    i = 0
    while i < len(line):
        ch = line[i]
        if ch == "\\" and i + 1 < len(line) and line[i + 1] == "|":
            cur.append("|")
            i += 2
            continue
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
        i += 1
    cells.append("".join(cur).strip())
    return cells[1:-1]


def _rows(page: str):
    """(line number, figure cell, whole row) of each results table's rows."""
    lines = (REPO / page).read_text().splitlines()
    column = None
    for n, line in enumerate(lines, 1):
        if not line.startswith("|"):
            column = None
            continue
        cells = _cells(line)
        if column is None:
            names = [c.strip().lower() for c in cells]
            column = next((names.index(c) for c in FIGURE_COLUMNS if c in names), -1)
            continue
        if column < 0 or set(line) <= set("|-: "):
            continue
        yield n, cells[column] if column < len(cells) else "", line


def _cited(page: str, row: str) -> list[pathlib.Path]:
    base = (REPO / page).parent
    names = _LINK.findall(row) + [c for c in _CODE.findall(row) if "results/" in c]
    paths = []
    for name in names:
        name = name.strip().rstrip(",;")
        if "results/" not in name or " " in name:
            continue
        paths.append((base / name).resolve())
    return paths


@functools.cache
def _numbers(path: pathlib.Path) -> frozenset[float]:
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    found = set()
    for f in files:
        if f.stat().st_size > 20_000_000:
            continue
        for m in _FILE_NUMBER.finditer(f.read_text(errors="replace")):
            found.add(float(m.group(1)))  # a mantissa as written: 4.8 of 4.8e-04
            if m.group(2):
                found.add(float(m.group()))
    return frozenset(found)


def figures(cell: str) -> list[tuple[str, float, int, str]]:
    """(as written, value, decimals, unit) of each figure in a cell."""
    cell = _LINK.sub("]", cell)
    out = []
    for m in _NUMBER.finditer(cell):
        num, unit = m.group("num"), (m.group("unit") or "").strip()
        if "." not in num and not unit:
            continue
        if _THRESHOLD.search(cell[:m.start()]):
            continue
        decimals = len(num.split(".")[1]) if "." in num else 0
        out.append((m.group(0).strip(), float(num), decimals, unit))
    return out


def found(value: float, decimals: int, unit: str, numbers: frozenset[float]) -> bool:
    scales = (1.0, 100.0, 1000.0)
    for x in numbers:
        candidates = [x * s for s in scales]
        if unit == "%":
            candidates.append(abs(x - 1.0) * 100.0)
        # Within half a unit of the figure's last digit, either way (306.5 as 307).
        if any(abs(c - value) <= 0.5 * 10 ** -decimals * (1 + 1e-9) for c in candidates):
            return True
    return False


def _all_rows():
    for page in PAGES:
        for n, cell, row in _rows(page):
            yield pytest.param(page, n, cell, row, id=f"{page}:{n}")


ROWS = list(_all_rows())


def test_the_pages_have_results_tables():
    pages = {p.values[0] for p in ROWS}
    assert pages == set(PAGES)
    assert sum(len(figures(p.values[2])) for p in ROWS) > 50


@pytest.mark.parametrize("page,line,cell,row", ROWS)
def test_each_figure_is_in_a_file_its_row_cites(page, line, cell, row):
    figs = figures(cell)
    cited = _cited(page, row)
    missing = [str(p.relative_to(REPO)) for p in cited if not p.exists()]
    assert not missing, f"{page}:{line} cites files that do not exist: {missing}"
    if not figs:
        return
    assert cited, f"{page}:{line} has figures {[f[0] for f in figs]} but cites no results file"
    pool = frozenset().union(*(_numbers(p) for p in cited))
    absent = [f[0] for f in figs if not found(f[1], f[2], f[3], pool)]
    assert not absent, (f"{page}:{line}: {absent} not found in "
                        f"{[str(p.relative_to(REPO)) for p in cited]}")


def test_the_convention_reads_figures_as_documented():
    cell = "GPT-2 b64 1.02, M=8 +5.6%, 912 ms, 259x, 5.04B, batch 256, goal 10%, H100"
    assert [f[0] for f in figures(cell)] == ["1.02", "+5.6%", "912 ms", "259x", "5.04B"]
    pool = frozenset({1.056, 0.912, 1.0213, 259.4, 5.04})
    assert all(found(v, d, u, pool) for _, v, d, u in figures(cell))
    assert not found(1.12, 2, "", pool)
