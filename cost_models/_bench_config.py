"""What every microbenchmark run shares: its sizes and repetitions.

`BenchConfig` (with the `FULL` and `QUICK` runs `hetpar profile` offers),
the host and JAX version a measurement's `source` names, and waiting for a
result. The device benchmarks (`_microbench`) and the link benchmarks
(`_link_bench`) both read them.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import socket

_MB = 1 << 20


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Sizes and repetitions of one profiling run.

    Attributes:
      matmul_sizes: n of the n x n x n matmuls, ascending.
      dtypes: matmul dtypes.
      stream_bytes: array sizes of the elementwise and reduction benchmarks.
      transfer_bytes: transfer sizes, ascending.
      k: timed repetitions (median reported).
      max_rep_s: skip a larger matmul once one repetition would exceed this.
      launch_calls: calls of the tiny op for the dispatch overhead.
    """

    matmul_sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    stream_bytes: tuple[int, ...]
    transfer_bytes: tuple[int, ...]
    k: int
    max_rep_s: float
    launch_calls: int


#: 4 KB, 16 KB, 64 KB, 256 KB, then 1 MiB .. 256 MiB at four sizes an octave
#: (multiples of 4 kB). The copies' seconds become a link's curve
#: (`LinkProfile.copy_curve`), and a curve interpolates across whatever
#: happens between two samples: on an H200 host, pinned host memory -> GPU
#: ran 31 GB/s at 27 MiB and 11 GB/s at 38 MiB, which a ladder of powers of
#: four (16, 64 MiB) would put anywhere between them
#: (experiments/results/links). Between samples 19% apart a fall costs at
#: most that step.
_TRANSFER_LADDER = (4096, 16384, 65536, 262144) + tuple(
    int(round(_MB * 2 ** (i / 4) / 4096)) * 4096 for i in range(33))

FULL = BenchConfig(
    matmul_sizes=(256, 512, 1024, 2048, 4096, 8192),
    dtypes=("f32", "bf16"),
    stream_bytes=(_MB, 16 * _MB, 256 * _MB),
    transfer_bytes=_TRANSFER_LADDER,
    k=7,
    max_rep_s=0.3,
    launch_calls=200,
)
QUICK = BenchConfig(
    matmul_sizes=(64, 128, 256),
    dtypes=("f32", "bf16"),
    stream_bytes=(256 * 1024, 4 * _MB),
    transfer_bytes=(4096, 64 * 1024, _MB, 16 * _MB),
    k=3,
    max_rep_s=0.1,
    launch_calls=50,
)


def _host_id() -> str:
    return f"{socket.gethostname()} ({platform.processor() or platform.machine()}, " \
           f"{os.cpu_count()} cores)"


def _block(x):
    import jax

    return jax.block_until_ready(x)


def _jax_version() -> str:
    import jax

    return jax.__version__
