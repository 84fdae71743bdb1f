"""Does how a CPU threads a GEMM explain its layer model's misses? (issue 17, offline)

The host CPU's layer model misses held-out layers by 14-16% median and
41-44% p90 on interleaved timings that repeat to 2-5% (results/cpu_timing),
and its in-sample capacity is 12-16%: its terms are linear in each class's
FLOPs, so a GEMM's time per FLOP is the same at every size. XLA's CPU
backend does not run a GEMM that way: it splits one over its thread pool in
blocks of some minimum work, so a small GEMM runs on one core (16x the
time per FLOP of a large one on the H100 host's 16), and one of a few
blocks on a few: time per FLOP falls with size until every core is busy.
This tries that as the GEMM's useful fraction on a CPU,

    u_e = min(cores, ceil(flops_e / grain)) / cores

for grains over four decades, and scores, for each, the fit on the first
interleaved pass against the held-out layers of the second, on the saved
runs of `probe_cpu_timing.py` (no device: re-traces the layers), as
`cpu_vector_tile.py` does for a vector tile.

    python experiments/cpu_threads.py [--runs results/cpu_timing/probe_cpu_timing.json ...]
"""

from __future__ import annotations

import math
import pathlib
import sys

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))

from cpu_vector_tile import CORES, gemm_terms, score_both_ways  # noqa: E402

#: FLOPs one thread of the pool takes at least; None: the model as hetpar has it.
GRAINS = (None, 1e4, 3e4, 1e5, 3e5, 1e6, 3e6, 1e7, 3e7, 1e8)


def threaded_terms(grain):
    """The layer model's terms on a CPU with each GEMM's FLOPs over its busy
    share of the cores; None (hetpar's terms) without a grain."""
    def seconds(e, peak):
        return e.flops / (min(CORES, math.ceil(e.flops / grain)) / CORES) / peak

    return None if grain is None else gemm_terms(seconds)


def main(argv=None) -> int:
    return score_both_ways(argv, __doc__, [(f"grain {g}", threaded_terms(g)) for g in GRAINS])


if __name__ == "__main__":
    raise SystemExit(main())
