"""Running split steps: the transfer engine and the per-device executor."""

from hetpar.runtime._executor import Executor, StageError, StageEvent
from hetpar.runtime._transfer import TransferEngine

__all__ = ["Executor", "StageError", "StageEvent", "TransferEngine"]
