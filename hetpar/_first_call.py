"""Where a step's first call spent its time (issue 41, item 6): `FirstCall`.

A `hetpar.auto` step's first call traces, costs (or, with
`profile="measure"`, calibrates), plans, splits and compiles, checks the
compiled stages' memory, and runs. Each part is timed here, as exclusive
time: a phase entered inside another (the cost table built while planning)
pauses the outer one, so the parts add up to no more than the whole.
`step.report()` prints them beside the first call's wall time.
"""

from __future__ import annotations

import contextlib
import time

#: The phases, in the order a first call meets them.
PHASES = ("trace", "costs", "calibrate", "plan", "compile", "memory check", "run")


class FirstCall:
    """Seconds per phase of one compiled step's first call (see module doc).

    `place` (the caller's `step.place(...)`, before the first call) and
    `total` (the first call's wall time, from the call to its results being
    ready, failed tries that were planned again included) are set apart.
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.total_s: float | None = None
        self.place_s: float | None = None
        # Spent building or placing the step before its first call (`lower()`,
        # `place()`), counted into `total_s`.
        self.before_s = 0.0
        self._stack: list[list] = []  # [phase, when it last resumed]

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.total_s is not None:  # after the first call (a report's costing): not its time
            yield
            return
        now = time.perf_counter()
        if self._stack:  # the outer phase pauses
            outer = self._stack[-1]
            self.seconds[outer[0]] = self.seconds.get(outer[0], 0.0) + now - outer[1]
        self._stack.append([name, now])
        try:
            yield
        finally:
            now = time.perf_counter()
            _, resumed = self._stack.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + now - resumed
            if self._stack:  # the outer phase goes on
                self._stack[-1][1] = now

    def ran(self, start: float, running: float) -> None:
        """The first call, begun at `start`, ran the step from `running` until
        its results were ready (now)."""
        now = time.perf_counter()
        self.seconds["run"] = self.seconds.get("run", 0.0) + now - running
        self.total_s = self.before_s + now - start

    @contextlib.contextmanager
    def after(self, name: str):
        """A part of the first call after its run (reading what the compiled
        step moves), counted into `total_s` and as phase `name`."""
        now = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - now
            self.seconds[name] = self.seconds.get(name, 0.0) + took
            if self.total_s is not None:
                self.total_s += took

    def absorb(self, earlier: FirstCall) -> None:
        """Adds the phases of a step built before this one for the same call (a
        plan whose compiled stages did not fit, planned again)."""
        for name, s in earlier.seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + s
        self.before_s += earlier.before_s

    def summary(self) -> dict:
        """{"total_s", "place_s", "phases": {phase: seconds}, "other_s"} (None where unknown)."""
        phases = {p: self.seconds[p] for p in (*PHASES, *sorted(set(self.seconds) - set(PHASES)))
                  if p in self.seconds}
        other = None if self.total_s is None else max(self.total_s - sum(phases.values()), 0.0)
        return {"total_s": self.total_s, "place_s": self.place_s, "phases": phases,
                "other_s": other}
