"""CPU + GPU execution on a real accelerator (skipped without a GPU)."""

import jax
import numpy as np
import pytest

import hetpar
from hetpar import zoo
from hetpar.runtime import TransferEngine

from .test_runtime import check_steps

pytestmark = pytest.mark.gpu


def test_transfer_engine_moves_values_both_ways():
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    engine = TransferEngine()
    x = np.arange(1 << 20, dtype=np.float32)
    on_gpu = engine.move(jax.device_put(x, cpu), gpu)
    back = engine.move(on_gpu, cpu)
    assert next(iter(on_gpu.devices())) == gpu and next(iter(back.devices())) == cpu
    np.testing.assert_array_equal(np.asarray(back), x)
    assert engine.path(gpu, cpu) == "pinned_host"
    assert engine.path(cpu, gpu) == "device_put"


@pytest.mark.parametrize("name", ["resnet18", "transformer", "cnn_preprocess"])
def test_cpu_gpu_alternating_plan_equals_jit(name):
    w = zoo.get(name, small=True, learning_rate=1e-4, batch=8)
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    plan = {n: ("gpu:0" if i % 2 else "cpu:0") for i, n in enumerate(layers)}
    # The oracle runs on the CPU. GPU matmuls run in TF32 by default, so force
    # full f32; cuDNN's convolutions still sum in another order than the CPU's
    # (the algorithm autotuning picks varies by compile), which BatchNorm
    # amplifies: over the small config's batch of 2, resnet18 differed by up
    # to 1.6e-3 in some runs on an H200 (2 of 4, either way the engine put its
    # copies); over 8 samples far less.
    with jax.default_matmul_precision("highest"):
        step = hetpar.auto(w.train_step, plan=plan)
        check_steps(w.train_step, step, args, rtol=5e-4)


def test_cpu_gpu_pipeline_1f1b():
    w = zoo.get("mlp", small=True, learning_rate=1e-4, batch=8)
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    plan = {n: ("cpu:0" if i == 0 else "gpu:0") for i, n in enumerate(layers)}
    with jax.default_matmul_precision("highest"):
        step = hetpar.auto(w.train_step, plan=plan, microbatches=4, schedule="1f1b")
        check_steps(w.train_step, step, args, microbatches=4, rtol=1e-4)


@pytest.mark.parametrize("update", ["cpu:0", "gpu:0"])
def test_offload_plan_on_gpu_equals_jit(update):
    # Compute on the GPU; parameters and optimizer state on the host CPU
    # between steps, updated there (ZeRO-Offload's split) or streamed to the
    # GPU for the update and sent back (issue 15).
    w = zoo.get("transformer", small=True, learning_rate=1e-4)
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    plan = {n: {"compute": "gpu:0", "state": "cpu:0", "update": update} for n in layers}
    with jax.default_matmul_precision("highest"):
        step = hetpar.auto(w.train_step, plan=plan)
        check_steps(w.train_step, step, args, rtol=5e-4)
    new_params, new_opt_state, _ = step(*args)
    cpu = jax.devices("cpu")[0]
    leaves = [x for x in jax.tree_util.tree_leaves((new_params, new_opt_state))
              if isinstance(x, jax.Array) and x.size > 1]
    assert leaves and all(cpu in x.devices() for x in leaves), \
        "offloaded state must come back to the host"


@pytest.mark.parametrize("params", ["gpu:0", "gpu:0:pinned_host"])
def test_state_in_gpu_pinned_host_memory_equals_jit(params):
    # JAX's host offload, per layer: optimizer state in gpu:0's pinned host
    # memory between steps, parameters on gpu:0 (or there too: fetched, the
    # weights moved in for each stage that reads them), each update on
    # gpu:0 with its state streamed in and the new state sent back (issue
    # 15). The copies in are donated to the new state (`_copies_donated`):
    # the state kept in the place survives every step.
    w = zoo.get("transformer", small=True, learning_rate=1e-4)
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    plan = {n: {"compute": "gpu:0", "params": params, "state": "gpu:0:pinned_host",
                "update": "gpu:0"} for n in layers}
    with jax.default_matmul_precision("highest"):
        step = hetpar.auto(w.train_step, plan=plan)
        args = step.place(*args)
        check_steps(w.train_step, step, args, rtol=5e-4)
    assert any(step._last._executor._donated_copies)
    for x in jax.tree_util.tree_leaves(args[:2]):
        assert not x.is_deleted()
    new_params, new_opt_state, _ = step(*args)
    kinds = {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(new_opt_state)
             if isinstance(x, jax.Array) and x.size > 1}
    assert kinds == {"pinned_host"}, kinds
    want = "device" if params == "gpu:0" else "pinned_host"
    assert {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(new_params)
            if isinstance(x, jax.Array) and x.size > 1} == {want}


def test_recomputed_layers_on_one_gpu_run_as_one_executable_that_holds_less():
    """A one-GPU plan recomputing its blocks runs as one executable
    (passes/_fuse.py) equal to jax.jit's step, and XLA kept the
    recomputation: more matmuls than jit's, fewer temporaries."""
    w = zoo.get("transformer", small=True, batch=16, seq_len=256, max_positions=256,
                d_model=128, num_heads=4, num_layers=6, vocab_size=512, learning_rate=1e-4)
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    plan = {n: {"compute": "gpu:0", "activations": "remat"} if n.startswith("h") else "gpu:0"
            for n in layers}
    with jax.default_matmul_precision("highest"):
        step = hetpar.auto(w.train_step, plan=plan)
        check_steps(w.train_step, step, args, rtol=5e-4)
        stages = step._last.stages
        assert len(stages.stages) == 1
        (fused,) = stages.stages
        sharding = jax.sharding.SingleDeviceSharding(jax.devices("gpu")[0])
        specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=sharding)
                 for v in fused.inputs]
        ours = step._last._executor.compiled[0].lower(*specs).compile()
        jits = jax.jit(w.train_step).lower(*jax.device_put(args, sharding)).compile()
    assert ours.as_text().count(" dot(") + ours.as_text().count("__cublas") > \
        jits.as_text().count(" dot(") + jits.as_text().count("__cublas")
    assert (ours.memory_analysis().temp_size_in_bytes
            < 0.7 * jits.memory_analysis().temp_size_in_bytes)


def test_an_out_of_memory_at_launch_deletes_donated_arguments_as_under_jit():
    """Why `_memory_check.MARGIN` is kept back before the first step: JAX
    gives donated buffers up even where the executable then cannot get its
    memory (seen on an H200, jax 0.11.2: the step failed at launch and its
    donated input was deleted), so an out-of-memory in a donating step
    loses the state, under jax.jit and hetpar.auto alike. hetpar says so in
    one line and does not retry on arrays that are gone; without donation
    the arguments stay whole (here, on one device, it then gives up in one
    line too; with another device to take state it plans again)."""
    import jax.numpy as jnp

    from hetpar._recovery import OutOfMemoryError

    gpu = jax.devices("gpu")[0]

    def big():
        return jax.device_put(jnp.arange(1 << 28, dtype=jnp.float32), gpu)  # 1 GiB

    x = big()
    copies = int(gpu.memory_stats()["bytes_limit"] // x.nbytes) + 2

    def step(x):  # an output larger than the GPU
        return x + 1, jnp.tile(x, copies)

    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED|[Oo]ut of memory"):
        jax.block_until_ready(jax.jit(step, donate_argnums=0)(x))
    assert x.is_deleted()
    x = big()
    with pytest.raises(OutOfMemoryError, match="donate_argnums.*deleted"):
        jax.block_until_ready(hetpar.auto(step, devices="gpu:0", donate_argnums=0)(x))
    x = big()
    with pytest.raises(OutOfMemoryError, match="arguments are unchanged"):
        jax.block_until_ready(hetpar.auto(step, devices="gpu:0")(x))
    assert not x.is_deleted()
    np.testing.assert_array_equal(np.asarray(x[:3]), [0, 1, 2])


def _needs_gpus(n: int) -> None:
    if len(jax.devices("gpu")) < n:
        pytest.skip(f"needs {n} GPUs")


# Compared at full f32: at the GPU's default (TF32) precision a half-batch
# matmul rounds apart from the whole batch's (gradients 5e-4 apart, relative,
# on two H200s, run 31), and Adam turns the attention key bias's gradient,
# zero but for rounding, into an update of either sign.
@pytest.mark.parametrize("stage", ["fsdp", "zero1"])
def test_sharded_state_over_two_gpus_equals_jit(stage):
    _needs_gpus(2)
    w = zoo.get("transformer", small=True, batch=8, learning_rate=1e-4)
    args = w.example_args()
    with jax.default_matmul_precision("highest"):
        step = hetpar.auto(w.train_step, devices=["gpu:0", "gpu:1"], data_parallel=stage)
        check_steps(w.train_step, step, args)
    assert step.lower(*args).plan.sharding == stage
    # The collectives read from the GPU's compiled HLO (NCCL's async forms),
    # and the prediction re-priced on them.
    summary = step.report().step
    got = summary["collectives"]
    assert got is not None and not got["in_loops"]
    assert sum(op["ring_bytes"] for op in got["compiled"].values()) > 0
    if stage == "fsdp":
        assert got["compiled"]["all-gather"]["count"] > 0
    assert summary["predicted_s"] == pytest.approx(
        got["planned_step_s"] - got["planned_s"] + got["compiled_s"])


def test_the_first_call_over_two_gpus_times_their_collectives(monkeypatch, tmp_path):
    # hetpar.auto's default (calibrated) over both GPUs and the host: the
    # group's all-gather and reduce-scatter are timed, and sharded state is
    # priced on that ring (meta["collectives"]); the plan equals jit. The
    # suite plans from spec sheets (conftest: HETPAR_CALIBRATE=0); this test
    # calibrates, as a user's first call does, into a cache of its own.
    _needs_gpus(2)
    monkeypatch.setenv("HETPAR_CALIBRATE", "1")
    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path))
    w = zoo.get("transformer", small=True, batch=8, learning_rate=1e-4)
    args = w.example_args()
    with jax.default_matmul_precision("highest"):
        step = hetpar.auto(w.train_step, devices=["gpu:0", "gpu:1", "cpu:0"])
        check_steps(w.train_step, step, args)
    ring = step.lower(*args).table.meta["collectives"]["gpu:0+gpu:1"]
    assert ring["bandwidth_bytes_per_s"] > 10e9 and 0 < ring["latency_s"] < 0.01


def test_place_links_are_timed_with_every_gpu_copying_both_ways():
    # What a plan streaming state on every GPU meets (fit_h200x2, run 35: two
    # H200s 31 GB/s each way at once, one alone 43 each way, 52 one way).
    from hetpar.runtime import place_link_figures

    gpus = jax.devices("gpu")
    one = place_link_figures(gpus[:1], nbytes=256 << 20)
    bw = "bandwidth_bytes_per_s"
    assert 5e9 < one[bw] < 200e9
    if len(gpus) > 1:  # (on one GPU "every" is "one" timed again: noise alone, run 69)
        every = place_link_figures(gpus, nbytes=256 << 20)
        assert 5e9 < every[bw] <= 1.1 * one[bw]
    # Each array of a batch is priced by its size: a small array costs more
    # per byte than the large one (on an H200: 16 kB ~80 us, 256 MiB at
    # ~44 GB/s), and every size was placed: the five batched sizes below the
    # whole, and the whole.
    sizes, secs = zip(*one["curve"])
    assert sizes[-1] == 256 << 20 and len(sizes) == 6 and secs[-1] > 0
    assert secs[0] / sizes[0] > 10 * secs[-1] / sizes[-1]
    assert 0 < one["latency_s"] < 0.01


def test_host_built_fsdp_state_lands_evenly_on_two_gpus():
    # Run 67: laying a host-built model's state out over two H200s, gpu:0 grew
    # 1.23x faster than gpu:1 and kept 6.8 GB no array held (each array went
    # to the default device whole to be cut into shards). Laid out from its
    # NumPy view (`host_view`), each GPU's allocator holds its shards and
    # little else (the fsdp step's results against jit: test_sharded_state_*).
    _needs_gpus(2)
    gpus = jax.devices("gpu")[:2]
    cpu = jax.devices("cpu")[0]
    w = zoo.get("transformer", batch=8, d_model=1024, num_layers=8, num_heads=16,
                learning_rate=1e-4)
    with jax.default_device(cpu):  # uncommitted on the host, as a loop builds it
        args = w.example_args()
    before = [(g.memory_stats() or {}).get("bytes_in_use", 0) for g in gpus]
    step = hetpar.auto(w.train_step, devices=["gpu:0", "gpu:1"], data_parallel="fsdp",
                       profile="spec", donate_argnums=(0, 1))
    placed = step.place(*args)
    jax.block_until_ready(placed)
    held = [(g.memory_stats() or {}).get("bytes_in_use", 0) - b for g, b in zip(gpus, before)]
    shards = [sum(s.data.nbytes for x in jax.tree_util.tree_leaves(placed[:2])
                  for s in x.addressable_shards if s.device == g) for g in gpus]
    state = sum(shards)
    assert state > 1e9
    for h, s in zip(held, shards):
        assert h <= s + 0.05 * state, (held, shards)  # nothing left beside the shards


def test_ring_latency_is_timed_from_chained_allreduces_over_two_gpus():
    # Timed as a small collective's call less a jitted no-op's, a ring step's
    # latency over two H200s came out 7-219 us on four calibrations (fit_h200x2,
    # runs 61-70). The chain keeps every all-reduce on the GPUs too (NCCL's),
    # and two timings give the figure each time.
    _needs_gpus(2)
    from hetpar._compiled_collectives import hlo_collectives
    from hetpar.runtime import ring_figures
    from hetpar.runtime._collective_bench import CHAIN, allreduce_chain

    gpus = jax.devices("gpu")[:2]
    program, arg = allreduce_chain(gpus, CHAIN, 64 << 10)
    assert hlo_collectives(program.lower(arg).compile().as_text(), 2)["all-reduce"]["count"] \
        == CHAIN
    figures = [ring_figures(gpus) for _ in range(2)]
    for bandwidth, latency in figures:
        assert 5e10 < bandwidth < 2e12 and 5e-6 <= latency < 1e-3
    print("ring (bandwidth, latency) twice:", figures)
