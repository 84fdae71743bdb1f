"""How hetpar prints quantities: seconds, bytes, counts. One definition each.

Every report, plan summary, CLI table and error message formats through
these, so a figure reads the same wherever it appears.
"""

from __future__ import annotations

import math

_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def seconds(x: float) -> str:
    """A duration with a readable unit: `1.23 s`, `4.5 ms`, `12 us`; `inf` and `0` as such."""
    if not math.isfinite(x):
        return "inf"
    if x == 0:
        return "0"
    if abs(x) >= 1:
        return f"{x:.3g} s"
    if abs(x) >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    return f"{x * 1e6:.3g} us"


def signed_seconds(x: float) -> str:
    """A change of duration: `+1.2 ms`, `-30 us`."""
    return ("+" if x >= 0 else "-") + seconds(abs(x))


def nbytes(n: float) -> str:
    """A size in decimal units: `1.5 GB`, `12 MB`, `3 kB`, `10 B`."""
    for scale, prefix in _PREFIXES[1:]:
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}B"
    return f"{n:.3g} B"


def human(x: float | None, unit: str = "") -> str:
    """A count with an SI prefix and no space (`1.23G`, `45kFLOP`); None prints as '?'."""
    if x is None:
        return "?"
    for scale, prefix in _PREFIXES:
        if abs(x) >= scale:
            return f"{x / scale:.3g}{prefix}{unit}"
    return f"{x:.3g}{unit}"
