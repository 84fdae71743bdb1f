"""Several accelerators plus the CPU, on virtual CPU devices.

Four CPU devices stand in for a host with two GPUs: cpu:2 and cpu:3 get H100
profiles (and an NVLink-class link between them), cpu:0 stays a CPU. The
planner must pipeline across the two "GPUs"; the split step must equal
`jax.jit` on one device.
"""

import itertools

import pytest

import hetpar
from hetpar import zoo
from hetpar.cost_models import LinkProfile, ProfileSet, cost_table, spec

from .test_runtime import check_steps

GPUS = ("cpu:2", "cpu:3")


def two_gpu_profiles() -> ProfileSet:
    devices = {name: spec("h100").replace(name=name, origin="measured") for name in GPUS}
    devices["cpu:0"] = spec("cpu").replace(name="cpu:0", origin="measured")
    links = []
    for a, b in itertools.permutations(["cpu:0", *GPUS], 2):
        peer = a in GPUS and b in GPUS
        # The small test model's layers take microseconds: links must be cheaper
        # still for a pipeline to pay off (the planner is right to refuse otherwise).
        links.append(LinkProfile(a, b, "device_put", 1e-8, 300e9 if peer else 25e9,
                                 "test: NVLink-class peer link, PCIe host link"))
    return ProfileSet(devices, tuple(links))


def test_cost_table_sees_two_gpus():
    w = zoo.get("transformer", small=True, batch=8)
    graph = hetpar.trace(w.train_step, *w.example_args())
    table = cost_table(graph, ["cpu:0", *GPUS], profiles=two_gpu_profiles())
    kinds = {d.name: d.kind for d in table.devices}
    assert kinds["cpu:2"] == kinds["cpu:3"] == "h100"
    layer = table.layers[2]
    assert layer.time_s["cpu:2"] == pytest.approx(layer.time_s["cpu:3"])
    assert layer.time_s["cpu:2"] < layer.time_s["cpu:0"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_over_two_gpus_equals_jit(schedule):
    w = zoo.get("transformer", small=True, batch=8, learning_rate=1e-4)
    args = w.example_args()
    step = hetpar.auto(w.train_step, devices=["cpu:0", *GPUS], profile=two_gpu_profiles(),
                       microbatches=4, schedule=schedule)
    compiled = step.lower(*args)
    used = set(compiled.assignment.values())
    assert used >= set(GPUS), compiled.plan.summary(compiled.table)  # both "GPUs" busy
    assert compiled.plan.mode == "pipelined"
    check_steps(w.train_step, step, args, microbatches=4)
