"""Does a GEMM's time grow slower than its FLOPs on a CPU? (issue 17, offline)

The host CPU's layer model misses held-out layers by 14-16% median and
41-44% p90 on interleaved timings that repeat to 2-5% (results/cpu_timing),
and its in-sample capacity is 12-16%. Its matmul terms are linear in each
class's FLOPs: a GEMM's time per FLOP is the same at every size. Neither a
vector tile (`cpu_vector_tile.py`) nor the thread pool's grain
(`cpu_threads.py`) helped. This tries the plainest ramp instead: each
equation's FLOPs raised to a power,

    flops_c = sum_e reps_e (flops_e / peak / S)^alpha * S

(S = 1 ms of work at the peak, so that alpha = 1 is hetpar's model and the
coefficients keep their scale), for alpha from 0.6 to 1, and optionally the
layer's non-matmul bytes alike (beta). Scored as the other two: the fit on
one interleaved pass, the held-out layers over 100 us of the other, on both
saved runs of `probe_cpu_timing.py` (no device: re-traces the layers).

    python experiments/cpu_power.py [--runs results/cpu_timing/probe_cpu_timing.json ...]
"""

from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))

from cpu_vector_tile import gemm_terms, score_both_ways  # noqa: E402

#: (alpha, beta) tried; (1, 1) is the model as hetpar has it.
POWERS = ((1.0, 1.0), (0.9, 1.0), (0.8, 1.0), (0.7, 1.0), (0.6, 1.0),
          (0.9, 0.9), (0.8, 0.8), (0.8, 0.9))
S = 1e-3  # seconds: the size at which a power leaves a term unchanged


def power_terms(alpha: float, beta: float):
    """The layer model's terms on a CPU with each GEMM's time, and the
    layer's non-matmul bytes' time, raised to a power about `S`."""
    gemms = gemm_terms(lambda e, peak: (e.flops / peak / S) ** alpha * S)

    def terms(profile, eqs, work):
        out = gemms(profile, eqs, work)
        out["bytes"] = (out["bytes"] / S) ** beta * S if out["bytes"] > 0 else 0.0
        return out

    return None if (alpha, beta) == (1.0, 1.0) else terms


def main(argv=None) -> int:
    return score_both_ways(argv, __doc__, [(f"alpha {a} beta {b}", power_terms(a, b))
                                           for a, b in POWERS])


if __name__ == "__main__":
    raise SystemExit(main())
