"""The errors hetpar raises at its boundaries.

Every error says what was wrong and how to fix it. They subclass ValueError
(bad input) so callers that already catch ValueError keep working, and all
share HetparError so the CLI can print them without a traceback.

How to fix it depends on who reads it: a Python caller changes arguments
(`on_missing_device='replan'`), a user of the `hetpar` command changes
flags (`--measure`). An error that gives advice carries both forms; `str()`
is the Python form, and the command line prints `for_cli()`.
"""

from __future__ import annotations


class HetparError(ValueError):
    """Base class of every error hetpar raises on bad input.

    Args:
      message: what was wrong.
      api: what to do about it, said to a Python caller (arguments), e.g.
        "pass measure=True". `str(error)` is `message; api`.
      cli: the same said to a user of the `hetpar` command (flags), e.g.
        "add --measure"; `for_cli()` gives `message; cli`. Without it the
        command line says what `api` says.
    """

    def __init__(self, message: str = "", *, api: str | None = None, cli: str | None = None):
        self.message = message
        self.advice = {k: v for k, v in (("api", api), ("cli", cli)) if v}
        super().__init__(self._with("api"))

    def _with(self, audience: str) -> str:
        advice = self.advice.get(audience) or self.advice.get("api")
        return f"{self.message}; {advice}" if advice else self.message

    def for_cli(self) -> str:
        """The message with the advice a user of the `hetpar` command can take."""
        return self._with("cli")

    def within(self, where: str) -> HetparError:
        """This error (same type and advice) with its message prefixed by `where: `,
        e.g. the file it was found in."""
        return type(self)(f"{where}: {self.message}", **self.advice)


class TraceError(HetparError):
    """A step function could not be traced or split into layers."""


class GraphFormatError(HetparError):
    """A graph.json file (or dict) is malformed."""


class PlanError(HetparError):
    """A plan is malformed, or does not fit the model or devices at hand."""


class InfeasibleError(PlanError):
    """No assignment satisfies the constraints (memory, links, pins, budgets)."""


class ProfileError(HetparError):
    """A device profile is malformed, unknown, or names a device that is not present."""


class UnknownModelError(HetparError):
    """A zoo model name or config key is unknown."""
