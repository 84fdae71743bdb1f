"""What one compiled executable holds at its peak, from XLA's own analysis."""

from __future__ import annotations


def executable_peak(m) -> float | None:
    """Peak bytes of an executable on one device from its `memory_analysis()`
    (`m`; None gives None): XLA's buffer-assignment peak where the backend
    reports one (`peak_memory_in_bytes`), else arguments + outputs +
    temporaries less the outputs aliased to donated arguments (a donated
    argument's buffer holds its result: counted once); plus the code.
    For a partitioned (SPMD) executable the figures are per device."""
    if m is None:
        return None
    peak = getattr(m, "peak_memory_in_bytes", 0) or 0
    if peak <= 0:
        peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                + m.temp_size_in_bytes)
    return float(peak + m.generated_code_size_in_bytes)
