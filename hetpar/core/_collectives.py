"""What collectives cost: the gradients' all-reduce of data parallelism, and
the all-gathers and reduce-scatters of sharded state.

Closed forms over a link's bandwidth and latency: the planner prices data
parallel with them, and `cost_models.scale_to_timed_step` takes the
all-reduce out of a measured data-parallel step to find what each replica
pays (both sides price it alike, so it lives here, below both).
"""

from __future__ import annotations


def ring_allreduce_s(nbytes: float, members: int, bandwidth_bytes_per_s: float,
                     latency_s: float = 0.0) -> float:
    """Seconds of a ring all-reduce of `nbytes` over `members`, as
    `hetpar.planner.evaluate_data_parallel` prices it: 2 (n - 1) steps (reduce-scatter, then
    all-gather), each sending nbytes / n over the ring's slowest link and
    paying its latency. 0 for one member."""
    n = int(members)
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * (latency_s + nbytes / n / bandwidth_bytes_per_s)


def ring_allgather_s(nbytes: float, members: int, bandwidth_bytes_per_s: float,
                     latency_s: float = 0.0) -> float:
    """Seconds of a ring all-gather of `nbytes` (the whole, gathered) over
    `members`: n - 1 steps, each sending nbytes / n over the ring's slowest
    link and paying its latency; half a ring all-reduce. A reduce-scatter
    of `nbytes` costs the same. 0 for one member."""
    return ring_allreduce_s(nbytes, members, bandwidth_bytes_per_s, latency_s) / 2


def hierarchical_allreduce_s(nbytes: float, groups: int, per_group: int,
                             intra_bandwidth_bytes_per_s: float,
                             inter_bandwidth_bytes_per_s: float, *,
                             intra_latency_s: float = 0.0,
                             inter_latency_s: float = 0.0) -> float:
    """Seconds of a two-level all-reduce of `nbytes` over `groups` x `per_group`
    members (hosts x GPUs): reduce-scatter inside each group, so each member
    holds 1 / per_group of the sum; all-reduce of those shards across the
    groups, the per_group rings at once, each on 1 / per_group of a group's
    `inter_bandwidth_bytes_per_s` (one NIC each, or one NIC shared evenly);
    all-gather inside each group. The two inside steps together cost one
    ring all-reduce inside the group (`ring_allreduce_s`), nothing overlaps."""
    p = int(per_group)
    inside = ring_allreduce_s(nbytes, p, intra_bandwidth_bytes_per_s, intra_latency_s)
    across = ring_allreduce_s(nbytes / p, groups, inter_bandwidth_bytes_per_s / p,
                              inter_latency_s)
    return inside + across
