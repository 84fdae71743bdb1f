"""The public names users call, as they call them."""

import jax

import hetpar


def test_hetpar_distributed_is_the_public_entry_point_for_several_processes():
    import hetpar.distributed as dist
    from hetpar import _distributed

    assert dist.initialize is _distributed.initialize and dist.gather is hetpar.gather
    assert dist.initialize() is False  # one process, not under hetpar.launch: nothing to join
    assert dist.device_name(jax.devices("cpu")[1]) == "cpu:1"
