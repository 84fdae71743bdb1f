"""Plans hold on the machine they run on: present devices are priced with what
this machine has (JAX's allocator limit, the host's RAM and cores), whatever
`profile=` says; `memory=` / `--memory` name devices and kinds, may give a
device planned for (not present) more memory, and never a present one."""

import os

import jax
import numpy as np
import pytest

import hetpar
from hetpar.core import PlanError
from hetpar.cost_models import cost_table, load_profiles
from hetpar.cost_models._devices import host_cores, live_capacity
from hetpar.cost_models._resolve import resolve_devices
from hetpar.planner._solve import with_memory

from . import oracle
from .flax_mlp import mlp_step as _mlp_step

GB = 1e9


def _host_ram() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _room() -> float:
    """What the host gives this process's arrays now (`host_room`): moves
    as other processes (the other test workers) allocate."""
    return live_capacity(jax.devices("cpu")[0])[0]


def _about_room(value) -> bool:
    return value <= _host_ram() and value == pytest.approx(_room(), rel=0.1)


def test_present_cpu_is_priced_as_this_machine_has_it_not_as_its_spec_sheet():
    spec = load_profiles().device("cpu")
    cpu, h100 = resolve_devices(["cpu:0", "h100"], load_profiles())
    # The spec sheet is a 16-core part with 128 GiB; this machine is what it is.
    assert _about_room(cpu.profile.memory_bytes) and cpu.profile.memory_bytes != spec.memory_bytes
    assert "sysconf" in cpu.profile.sources["memory_bytes"]
    scale = host_cores() / 16
    assert cpu.profile.peak_flops_per_s["f32"] == pytest.approx(spec.peak_flops_per_s["f32"]
                                                                 * scale)
    assert f"{host_cores()} cores here" in cpu.profile.sources["peak_flops_per_s.f32"]
    # A device planned for, not present, keeps its sheet.
    assert h100.profile.memory_bytes == load_profiles().device("h100").memory_bytes


def test_a_profile_measured_elsewhere_keeps_its_times_but_takes_this_machines_capacity():
    elsewhere = load_profiles().device("cpu").replace(
        name="cpu:0", origin="measured", memory_bytes=2e12,
        peak_flops_per_s={"f32": 1e13, "bf16": 2e13})
    profiles = load_profiles().replace_devices({"cpu:0": elsewhere})
    (cpu,) = resolve_devices(["cpu:0"], profiles)
    assert _about_room(cpu.profile.memory_bytes)
    assert cpu.profile.peak_flops_per_s["f32"] == 1e13  # measured figures are not rescaled


def test_the_host_gives_arrays_what_is_available_and_what_they_hold():
    """A CPU's capacity is the RAM this process's arrays may use: what the
    OS has available plus what its host arrays hold already, not the RAM
    the process holds beside them (Python, libraries, compiled code) nor
    other processes'. A 6.74B plan checked at 115 GB of host arrays on a
    134 GB host was killed by the OS: the process held ~9 GB beside its
    arrays (fit_h200, run 51)."""
    from hetpar.cost_models._devices import host_array_bytes, room_for_arrays

    # 134 GB, 40 GB available, the process resident at 90 GB of which 81 GB arrays.
    assert room_for_arrays(134 * GB, 40 * GB, 90 * GB, 81 * GB) == 121 * GB
    assert room_for_arrays(134 * GB, 130 * GB, 3 * GB, 0.0) == 130 * GB
    # Arrays counted at most at what is resident (not yet touched pages).
    assert room_for_arrays(134 * GB, 40 * GB, 10 * GB, 81 * GB) == 50 * GB
    assert room_for_arrays(134 * GB, 134 * GB, 10 * GB, 10 * GB) == 134 * GB
    import gc

    gc.collect()
    before = host_array_bytes()
    x = jax.device_put(np.ones((1 << 20,), np.float32), jax.devices("cpu")[0])
    assert host_array_bytes() - before == x.nbytes
    # Each buffer once: an array over the same buffer adds nothing, one
    # replicated over two CPU devices holds two, a deleted one none.
    same = jax.device_put(x, jax.devices("cpu")[0])
    assert host_array_bytes() - before == x.nbytes
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("d",))
    both = jax.device_put(np.ones((1 << 18,), np.float32),
                          jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    assert host_array_bytes() - before == x.nbytes + 2 * both.nbytes
    both.delete()
    assert host_array_bytes() - before == x.nbytes
    del x, same
    assert 0 < _room() <= _host_ram()


def test_the_pinned_pools_spare_regions_are_the_processs_room(monkeypatch):
    """XLA's pinned pool keeps the regions it grew to: holding 77.1 GB of
    state in a pool of 93 GiB, its spare 22.8 GB are neither available to
    the OS nor arrays, yet a plan may use them (counted as the pool's
    regions, they would be counted twice: a replan after a step)."""
    from hetpar.cost_models import _devices

    GiB = float(1 << 30)
    assert _devices.pool_spare(0.0, 93 * GiB) == 0.0
    assert _devices.pool_spare(77.1e9, 93 * GiB) == pytest.approx(93 * GiB - 77.1e9)
    assert _devices.pool_spare(3 * GiB, 93 * GiB) == 1 * GiB - 2 * 2**20  # 4 GiB - 2 MiB
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "93")
    # A 134 GB host, the process resident at 115 GB (the pool's 93 GiB with
    # 77.1 GB of arrays in it, and 15 GB of its own), 19 GB available.
    monkeypatch.setattr(_devices, "os_memory", lambda: (19e9, 115e9))
    monkeypatch.setattr(_devices, "host_arrays", lambda: (77.1e9, 77.1e9))
    assert _devices.host_room(134e9) == pytest.approx(19e9 + 93 * GiB)
    monkeypatch.setattr(_devices, "host_arrays", lambda: (77.1e9, 0.0))  # on a CPU device
    assert _devices.host_room(134e9) == pytest.approx(19e9 + 77.1e9)


def test_host_arrays_are_counted_where_the_default_backend_is_an_accelerator(monkeypatch):
    """`jax.live_arrays()` lists the default backend's arrays alone: on a GPU
    host the state built on the CPU device went uncounted, and a 6.74B
    model's host was planned with 52 GB of its 134 (fit_h200, run 52)."""
    from hetpar.cost_models._devices import host_array_bytes

    x = jax.device_put(np.ones((1 << 20,), np.float32), jax.devices("cpu")[0])
    real = jax.live_arrays

    def as_on_a_gpu_host(platform=None):
        if platform is None:  # the default backend: the GPU's arrays, not these
            return []
        if platform == "cuda":
            return []
        return real(platform)

    monkeypatch.setattr(jax, "default_backend", lambda: "cuda")
    monkeypatch.setattr(jax, "live_arrays", as_on_a_gpu_host)
    assert host_array_bytes() >= x.nbytes


def test_live_capacity_reads_the_allocator_limit_of_an_accelerator():
    class FakeGpu:  # the one field of jax.Device that differs on a GPU host
        platform, process_index = "gpu", jax.process_index()

        def memory_stats(self):
            return {"bytes_limit": 112.6e9, "bytes_in_use": 0}

    mem, source = live_capacity(FakeGpu())
    assert mem == 112.6e9 and "bytes_limit" in source


@pytest.mark.parametrize("profile", ["auto", None])
def test_cost_tables_record_what_present_devices_hold(profile):
    graph = hetpar.trace(lambda w, x: (w * x).sum(), jax.numpy.ones(4), jax.numpy.ones(4))
    table = cost_table(graph, ["cpu:0", "cpu:1", "h100"],
                       profiles=None if profile is None else load_profiles())
    caps = table.meta["present_capacity"]
    assert _about_room(caps["cpu:0"]) and _about_room(caps["cpu:1"])
    assert "h100:0" not in caps
    assert {d.name: d.memory_bytes for d in table.devices}["cpu:0"] == caps["cpu:0"]


def _table():
    graph = hetpar.trace(lambda w, x: (w * x).sum(), jax.numpy.ones(4), jax.numpy.ones(4))
    return cost_table(graph, ["cpu:0", "h100", "h100"], profiles=load_profiles())


def test_memory_names_a_kind_for_every_device_of_it_and_may_raise_one_not_present():
    table = _table()
    mem = {d.name: d.memory_bytes for d in with_memory(table, {"h100": 10 * GB}).devices}
    assert mem["h100:0"] == mem["h100:1"] == 10 * GB
    # A DGX-sized card is planned for: more than its sheet's 80 GB.
    mem = {d.name: d.memory_bytes for d in with_memory(table, {"h100:1": 2000 * GB,
                                                                "h100": 10 * GB}).devices}
    assert mem["h100:1"] == 2000 * GB and mem["h100:0"] == 10 * GB  # the name wins


def test_memory_cannot_give_a_present_device_more_than_it_holds():
    table = _table()
    capped = with_memory(table, {"cpu:0": 1 * GB})
    assert {d.name: d.memory_bytes for d in capped.devices}["cpu:0"] == 1 * GB
    with pytest.raises(PlanError, match="present here and holds .* cannot be given memory"):
        with_memory(table, {"cpu:0": 100 * _host_ram()})
    with pytest.raises(PlanError, match="present here"):
        with_memory(table, {"cpu": 100 * _host_ram()})


def test_memory_refuses_a_comma_list_and_names_what_it_knows():
    table = _table()
    with pytest.raises(PlanError, match="one device or kind per entry"):
        with_memory(table, {"h100:0,h100:1": 10 * GB})
    with pytest.raises(PlanError, match="kinds: cpu, h100"):
        with_memory(table, {"tpu-v4": 10 * GB})


def test_cli_memory_takes_kinds_and_says_to_repeat_the_flag():
    from hetpar.cli._plan import parse_memory
    from hetpar.core import HetparError

    assert parse_memory(["h100=10", "cpu=2000"]) == {"h100": 10 * GB, "cpu": 2000 * GB}
    with pytest.raises(HetparError, match="repeat the flag"):
        parse_memory(["gpu:0=40,gpu:1=40"])


def test_auto_refuses_more_memory_than_a_present_device_holds():
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: ((w * x) ** 2).sum())(w), 0.0

    auto = hetpar.auto(step, devices=["cpu:0", "cpu:1"], profile=None,
                       memory={"cpu:1": 100 * _host_ram()})
    with pytest.raises(PlanError, match="cannot be given memory it does not have"):
        auto(jax.numpy.ones(8), jax.numpy.ones(8))


# -- out of memory mid-step: replanned, retried, the caller's state intact ------




class _Allocator:
    """A fake allocator limit: an executor whose stages on one device read at
    least `limit` bytes of inputs there fails at run time as XLA does when out
    of memory (RESOURCE_EXHAUSTED). The first executor built sets the limit to
    what its busiest device needs there: only a plan that keeps less on that
    device (`device`) runs."""

    def __init__(self):
        self.device, self.limit, self.failed = None, None, 0

    def install(self, monkeypatch):
        from hetpar.runtime import _executor

        original = _executor.Executor._compile_all

        def compile_all(executor, stages):
            compiled = original(executor, stages)
            held: dict = {}
            for st in stages:
                held[st.device] = held.get(st.device, 0) + sum(
                    v.aval.size * v.aval.dtype.itemsize for v in st.inputs)
            if self.limit is None:
                self.device = max(held, key=held.get)
                self.limit = held[self.device]
            busiest = self.device
            if held.get(busiest, 0) < self.limit:
                return compiled

            def out_of_memory(*args):
                self.failed += 1
                raise RuntimeError(f"RESOURCE_EXHAUSTED: Out of memory while trying to "
                                   f"allocate {held[busiest]} bytes.")

            return [out_of_memory if st.device == busiest else fn
                    for st, fn in zip(stages, compiled)]

        monkeypatch.setattr(_executor.Executor, "_compile_all", compile_all)


def _copy(tree):
    return jax.tree_util.tree_map(lambda a: np.array(a, copy=True), tree)


@pytest.mark.slow  # 3-5 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_a_stage_out_of_memory_is_replanned_and_retried_with_the_state_intact(monkeypatch):
    step, args = _mlp_step()
    before = _copy(args)
    alloc = _Allocator()
    alloc.install(monkeypatch)
    # Capped so that the step needs two devices of three.
    held = sum(x.nbytes for x in jax.tree_util.tree_leaves(args[:2]))
    cap = 0.6 * 3 * held  # parameters, gradients and Adam's two moments
    auto = hetpar.auto(step, devices=["cpu:0", "cpu:1", "cpu:2"], profile=None,
                       memory=dict.fromkeys(["cpu:0", "cpu:1", "cpu:2"], cap))
    with pytest.warns(hetpar.OutOfMemoryWarning, match="ran out of memory"):
        out = auto(*args)
    assert alloc.failed >= 1
    # The step that ran was planned again with the device that ran out capped lower.
    assert auto.options.memory[alloc.device] < cap
    # The caller's arrays are untouched, and the result is jax.jit's.
    for a, b in zip(jax.tree_util.tree_leaves(args), jax.tree_util.tree_leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)
    oracle.assert_equals_jit(out, step, args)


def test_out_of_memory_under_a_given_plan_is_one_line_naming_the_device(monkeypatch):
    step, args = _mlp_step()
    alloc = _Allocator()
    alloc.install(monkeypatch)
    layers = hetpar.trace(step, *args).layers
    plan = {name: ("cpu:0" if i < 3 else "cpu:1") for i, name in enumerate(layers)}
    auto = hetpar.auto(step, devices=["cpu:0", "cpu:1"], plan=plan, profile=None)
    with pytest.raises(hetpar.OutOfMemoryError) as info:
        auto(*args)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{alloc.device} ran out of memory") and "B more)" in message
    assert "the plan was given" in message and "arguments are unchanged" in message


def test_out_of_memory_is_blamed_on_the_gpu_whose_allocator_ran_out():
    from hetpar._recovery import bytes_wanted, failed_device, smaller_cap
    from hetpar.runtime import StageError

    xla = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 760.01MiB "
                       "with allocator GPU_0_bfc on device 0.")
    try:  # read off a later stage's result on the host: the GPU still ran out
        raise StageError("stage 3 on cpu:0 failed", device="cpu:0") from xla
    except StageError as e:
        read_on_host = e
    assert failed_device(read_on_host, ["cpu:0", "gpu:0"]) == "gpu:0"
    assert failed_device(StageError("x", device="cpu:1"), ["cpu:0", "cpu:1"]) == "cpu:1"
    assert bytes_wanted(read_on_host) == pytest.approx(760.01 * 2**20)
    # Each try asks for less, and the allocation that failed comes off the top.
    caps = [smaller_cap(100 * GB, 90 * GB, tries, 1 * GB) for tries in range(3)]
    assert caps[0] == pytest.approx(0.85 * 90 * GB - 1 * GB) and caps[0] > caps[1] > caps[2]


def test_out_of_memory_while_compiling_a_replanned_step_plans_again(monkeypatch):
    """XLA's autotuner can run out of memory compiling the new plan beside the
    state (an H200 at 15 GB: RESOURCE_EXHAUSTED, 'Failed to get configs'):
    that is one more try, not an escape."""
    from hetpar.runtime import _executor

    step, args = _mlp_step()
    alloc = _Allocator()
    alloc.install(monkeypatch)
    compile_all = _executor.Executor._compile_all
    built = []

    def autotuner_out_of_memory_once(executor, stages):
        built.append(len(stages))
        if len(built) == 2:  # the first replanned step
            raise RuntimeError("RESOURCE_EXHAUSTED: Failed to get configs for: 2 out of 42 "
                               "instructions.")
        return compile_all(executor, stages)

    monkeypatch.setattr(_executor.Executor, "_compile_all", autotuner_out_of_memory_once)
    held = sum(x.nbytes for x in jax.tree_util.tree_leaves(args[:2]))
    cap = 0.6 * 3 * held
    auto = hetpar.auto(step, devices=["cpu:0", "cpu:1", "cpu:2"], profile=None,
                       memory=dict.fromkeys(["cpu:0", "cpu:1", "cpu:2"], cap))
    with pytest.warns(hetpar.OutOfMemoryWarning):
        out = auto(*args)
    assert len(built) >= 3 and alloc.failed >= 1
    oracle.assert_equals_jit(out, step, args)


# -- donation ----------------------------------------------------------------------


def test_donated_state_is_replaced_on_one_device_as_under_jax_jit():
    step, args = _mlp_step()
    inputs = _copy(args)
    auto = hetpar.auto(step, devices="cpu:0", donate_argnums=(0, 1))
    params, opt_state, batch = jax.device_put(args, jax.devices("cpu")[0])
    out = auto(params, opt_state, batch)
    # The state passed was donated (its buffers hold the new state), the batch not.
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves((params, opt_state)))
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(batch))
    oracle.assert_equals_jit(out, step, inputs)
    inputs = _copy(out)
    out2 = auto(out[0], out[1], batch)  # the returned state goes in next, as with jax.jit
    oracle.assert_equals_jit(out2, step, (inputs[0], inputs[1], batch))
    # Passing the donated state again is one line that says what happened.
    with pytest.raises(hetpar.HetparError, match="donate_argnums=\\(0, 1\\) gave its buffers"):
        auto(params, opt_state, batch)


def test_a_split_plan_with_donate_argnums_gives_up_the_callers_state_and_equals_jit():
    # (tests/test_donation.py checks donation in split and offload plans in full.)
    step, args = _mlp_step()
    layers = hetpar.trace(step, *args).layers
    plan = {name: ("cpu:0" if i < 3 else "cpu:1") for i, name in enumerate(layers)}
    auto = hetpar.auto(step, devices=["cpu:0", "cpu:1"], plan=plan, profile=None,
                       donate_argnums=(0, 1))
    inputs = _copy(args)
    out = auto(*args)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(args[:2]))
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(args[2]))
    oracle.assert_equals_jit(out, step, inputs)


def test_donate_argnums_is_checked():
    with pytest.raises(hetpar.HetparError, match="donate_argnums must be"):
        hetpar.auto(lambda x: x, donate_argnums="params")
    step, args = _mlp_step()
    with pytest.raises(hetpar.HetparError, match="name arguments \\[5\\]"):
        hetpar.auto(step, devices="cpu:0", donate_argnums=5)(*args)


def test_data_parallel_with_donate_argnums_equals_jit():
    step, args = _mlp_step()
    auto = hetpar.auto(step, devices=["cpu:0", "cpu:1"], data_parallel="always",
                       donate_argnums=(0, 1))
    inputs = _copy(args)
    out = auto(*args)
    oracle.assert_equals_jit(out, step, inputs)
    inputs = _copy((out[0], out[1], args[2]))
    out = auto(out[0], out[1], args[2])
    oracle.assert_equals_jit(out, step, inputs)


def test_a_gpus_memory_place_holds_what_xlas_pinned_pool_allows(monkeypatch):
    """XLA's GPU client keeps pinned host memory in a pool of its own, 64 GiB
    unless XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB says otherwise: a plan keeping
    a 6.74B model's 77 GB of state there failed placing it (fit_h200, run 53)."""
    from hetpar._host_memory import pinned_pool_bytes

    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    assert pinned_pool_bytes() == 64 * 2**30
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "120")
    assert pinned_pool_bytes() == 120 * 2**30
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "lots")
    assert pinned_pool_bytes() == 64 * 2**30


def test_a_plan_full_at_the_pinned_pool_says_how_to_raise_it(monkeypatch):
    import types

    from hetpar._compiled_step import CompiledStep
    from hetpar.planner import Device, Predicted

    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    pool = 64 * 2**30
    gpu = types.SimpleNamespace(platform="gpu")
    table = types.SimpleNamespace(devices=(Device("gpu:0", "h200", 45e9),
                                           Device("gpu:0:pinned_host", "pinned_host", pool)))

    def step(place_gb):
        predicted = Predicted(1.0, 0.0, 0.0, {}, peak_memory_bytes={
            "gpu:0": 40e9, "gpu:0:pinned_host": place_gb * 1e9})
        return types.SimpleNamespace(plan=types.SimpleNamespace(predicted=predicted),
                                     table=table, devices={"gpu:0": gpu})

    from hetpar import _memory_check

    monkeypatch.setattr(_memory_check, "host_ram", lambda: 134e9)
    monkeypatch.setattr(_memory_check, "host_total", lambda: 125 * 2**30)
    hint = CompiledStep._pinned_pool_hint(step(68.0))
    # three quarters of the RAM, as `import hetpar` sets it: the pool's
    # regions hold up to twice what it serves (the whole RAM ran out, run 56)
    assert "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=93" in hint and "gpu:0:pinned_host" in hint
    assert CompiledStep._pinned_pool_hint(step(30.0)) is None
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "93")  # widened already
    big = types.SimpleNamespace(devices=(Device("gpu:0", "h200", 45e9),
                                         Device("gpu:0:pinned_host", "pinned_host", 93 * 2**30)))
    assert CompiledStep._pinned_pool_hint(
        types.SimpleNamespace(**{**vars(step(99.0)), "table": big})) is None
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
    # A host with no RAM beyond the pool gains nothing from a larger one.
    monkeypatch.setattr(_memory_check, "host_ram", lambda: 70e9)
    assert CompiledStep._pinned_pool_hint(step(68.0)) is None


def test_a_memory_place_without_a_table_figure_holds_the_hosts_ram(monkeypatch):
    """A plan given without a cost table: a GPU's pinned host memory holds
    the host's RAM within XLA's pinned pool, not the GPU's allocator limit."""
    import types

    from hetpar import _memory_check

    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    monkeypatch.setattr(_memory_check, "host_ram", lambda: 134e9)
    gpu = types.SimpleNamespace(platform="gpu", process_index=jax.process_index(),
                                memory_stats=lambda: {"bytes_limit": 45e9})
    step = types.SimpleNamespace(options=types.SimpleNamespace(memory=None), table=None,
                                 devices={"gpu:0": gpu})
    caps = _memory_check.capacities(step, ["gpu:0", "gpu:0:pinned_host"])
    assert caps == {"gpu:0": 45e9, "gpu:0:pinned_host": 64 * 2**30}
