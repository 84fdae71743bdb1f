"""The errors hetpar raises at its boundaries.

Every error says what was wrong and how to fix it. They subclass ValueError
(bad input) so callers that already catch ValueError keep working, and all
share HetparError so the CLI can print them without a traceback.
"""


class HetparError(ValueError):
    """Base class of every error hetpar raises on bad input."""


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
