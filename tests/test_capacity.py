"""Plans hold on the machine they run on: present devices are priced with what
this machine has (JAX's allocator limit, the host's RAM and cores), whatever
`profile=` says; `memory=` / `--memory` name devices and kinds, may give a
device planned for (not present) more memory, and never a present one."""

import os

import jax
import pytest

import hetpar
from hetpar.core import PlanError
from hetpar.cost_models import cost_table, load_profiles
from hetpar.cost_models._devices import host_cores, live_capacity
from hetpar.cost_models._resolve import resolve_devices
from hetpar.planner._solve import with_memory

GB = 1e9


def _host_ram() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def test_present_cpu_is_priced_as_this_machine_has_it_not_as_its_spec_sheet():
    spec = load_profiles().device("cpu")
    cpu, h100 = resolve_devices(["cpu:0", "h100"], load_profiles())
    # The spec sheet is a 16-core part with 128 GiB; this machine is what it is.
    assert cpu.profile.memory_bytes == _host_ram() != spec.memory_bytes
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
    assert cpu.profile.memory_bytes == _host_ram()
    assert cpu.profile.peak_flops_per_s["f32"] == 1e13  # measured figures are not rescaled


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
    assert caps["cpu:0"] == caps["cpu:1"] == _host_ram()
    assert "h100:0" not in caps
    assert {d.name: d.memory_bytes for d in table.devices}["cpu:0"] == _host_ram()


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
