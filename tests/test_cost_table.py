"""cost_table and `hetpar costs`: from a traced zoo model to the planner's graph.json."""

import functools

import numpy as np
import pytest

from hetpar import cost_models, zoo
from hetpar.core import CostTable, ProfileError
from hetpar.cost_models import _measure


@functools.cache
def _lm():
    return zoo.trace_model("lm_embed", small=True)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path / "cache"))


def test_predicted_table_is_valid_and_matches_the_graph():
    _, graph = _lm()
    table = cost_models.cost_table(graph, ["cpu:0", "cpu:1", "h100"])
    assert isinstance(table, CostTable)
    # Beside the H100, its pinned host memory: a memory place where nothing computes.
    assert table.device_names == ("cpu:0", "cpu:1", "h100:0", "h100:0:pinned_host")
    assert [d.kind for d in table.devices] == ["cpu", "cpu", "h100", "pinned_host"]
    assert table.layer_names == tuple(graph.layers)
    for layer in table.layers:
        assert all(t > 0 for t in layer.time_s.values())
        assert set(layer.memory_bytes.values()) == {graph[layer.name].memory_bytes}
    assert {(e.src, e.dst, e.bytes, e.bytes_backward) for e in table.edges} == {
        (u, v, d["bytes"], d["bytes_backward"]) for u, v, d in graph.graph.edges(data=True)
    }
    # Every ordered pair of devices is linked, the place to its H100 alone; the
    # host CPU beside the H100 costs nothing extra.
    assert len(table.links) == 6 + 2
    assert table.device("cpu:0").price_per_hour == 0.0
    assert table.device("h100:0").price_per_hour > 0
    CostTable.from_json(table.to_json())  # round trip validates


def test_bigger_layer_predicts_slower():
    _, graph = _lm()
    table = cost_models.cost_table(graph, ["cpu:0", "h100"])
    by_flops = sorted(graph.layers, key=lambda n: graph[n].flops + graph[n].bytes_accessed)
    small, big = by_flops[0], by_flops[-1]
    for dev in table.layers[0].time_s:  # the devices layers compute on
        assert table.layers[table.layer_names.index(big)].time_s[dev] > \
            table.layers[table.layer_names.index(small)].time_s[dev]


def test_measure_uses_the_cache_the_second_time(monkeypatch):
    _, graph = _lm()
    groups = []
    real = _measure._time_group

    def counting(items, *args, **kw):
        groups.append([it.key for it in items])
        return real(items, *args, **kw)

    monkeypatch.setattr(_measure, "_time_group", counting)
    first = cost_models.cost_table(graph, ["cpu:0"], measure=True, k=2)
    # A CPU's layers are timed together, once each, in one group.
    assert len(groups) == 1 and len(groups[0]) == len(graph.layers)
    assert first.meta["measured_s"].keys() == set(graph.layers)
    second = cost_models.cost_table(graph, ["cpu:0"], measure=True, k=2)
    assert len(groups) == 1  # all cache hits
    assert second.layers == first.layers


def test_measured_layers_are_planned_at_their_typical_time(monkeypatch):
    # A layer whose runs were sometimes interrupted: the table holds the lower
    # quartile of its runs (Timing.typical_s), not the median the interruptions moved.
    _, graph = _lm()
    runs = [1e-3] * 5 + [1.5e-3] + [8e-3] * 4

    def fake(items, dev, *, k, warmup, budget_s=None):
        assert k == cost_models.LAYER_RUNS  # the default
        return [list(runs) for _ in items]

    monkeypatch.setattr(_measure, "_time_group", fake)
    table = cost_models.cost_table(graph, ["cpu:0"], measure=True)
    for layer in graph.layers:
        assert table.meta["measured_s"][layer]["cpu:0"] == pytest.approx(1e-3)
    assert _measure.Timing.of(runs).median_s == pytest.approx(1.25e-3)


def test_measure_on_an_absent_device_is_a_clear_error():
    _, graph = _lm()
    with pytest.raises(ProfileError, match="not present"):
        cost_models.cost_table(graph, ["cpu:0", "gpu:0"], measure=True)


def test_unknown_device_kind_is_a_clear_error():
    _, graph = _lm()
    with pytest.raises(ProfileError, match="unknown device kind 'quantum'"):
        cost_models.cost_table(graph, ["cpu:0", "quantum"])


def test_cli_writes_a_graph_json_the_planner_loads(tmp_path, capsys):
    from hetpar.cli import _main, _parser

    out = tmp_path / "graph.json"
    args = _parser().parse_args(["costs", "lm_embed", "--small", "--devices", "cpu:0,h100",
                                 "--measure", "--k", "2", "--out", str(out)])
    assert _main(args) == 0
    printed = capsys.readouterr().out
    assert "h100:0" in printed and "$" in printed and "J" in printed
    table = CostTable.load(out)
    assert table.device_names == ("cpu:0", "h100:0", "h100:0:pinned_host")
    assert "memory place" in printed
    assert table.meta["model"] == "lm_embed"


def test_cli_measure_absent_device_exits_with_an_error(capsys):
    from hetpar.cli import _main, _parser

    args = _parser().parse_args(["costs", "lm_embed", "--small", "--devices", "gpu:0",
                                 "--measure"])
    assert _main(args) == 2
    assert "not present" in capsys.readouterr().err


def test_layer_work_counts_buffers_and_io_bytes():
    from hetpar.cost_models import graph_layer_work, layer_io

    _, graph = _lm()
    for name in graph.layers:
        n, io = layer_io(graph, name)
        closed, _, _ = graph.layer_jaxpr(name)
        assert n <= len(closed.jaxpr.invars) + len(closed.jaxpr.outvars)
        assert n > 0 and io > 0
        w = graph_layer_work(graph, name)
        assert (w.buffers, w.io_bytes) == (n, io)


def test_scale_to_step_matches_whole_step_and_keeps_ratios():
    from hetpar.cost_models import scale_to_step
    from hetpar.planner import evaluate

    table = zoo.cost_table("mlp", ["cpu:0"], small=True)
    scaled = scale_to_step(table, {"cpu:0": 0.5})
    one = {layer: "cpu:0" for layer in scaled.layer_names}
    assert evaluate(scaled, one).step_time_s == pytest.approx(0.5)
    a, b = table.layers[0].time_s["cpu:0"], table.layers[1].time_s["cpu:0"]
    ratio = scaled.layers[0].time_s["cpu:0"] / scaled.layers[1].time_s["cpu:0"]
    assert ratio == pytest.approx(a / b)
    assert scaled.fingerprint() == table.fingerprint()
    with pytest.raises(ProfileError, match="not devices of the table"):
        scale_to_step(table, {"gpu:7": 1.0})
    with pytest.raises(ProfileError, match="must be positive seconds"):
        scale_to_step(table, {"cpu:0": 0.0})


# Known per-layer costs t(batch) = fixed + per_sample x batch at the MLP's
# batch 4 and its microbatch 2, by layer: fc1 recovers its fixed part; fc2
# grows faster than its batch (superlinear, the fit says -2 ms: none); fc3 is
# slower at the smaller batch (noise: the fit says more than its time: all).
KNOWN_COSTS = {"fc1": {4: 4e-3, 2: 3e-3}, "fc2": {4: 4e-3, 2: 1e-3}, "fc3": {4: 1e-3, 2: 1.5e-3}}
KNOWN_FIXED = {"fc1": 2e-3, "fc2": 0.0, "fc3": 1e-3}


def known_layer_times(monkeypatch, costs=KNOWN_COSTS):
    """Makes measure=True time each layer at `costs[layer][batch]`, the
    batch read from the graph it is measured in (the step at batch or at
    batch / M)."""
    from hetpar.cost_models import _table

    def measure_layer(graph, layer, device, **_):
        roles = zip(graph.program.jaxpr.jaxpr.invars, graph.input_roles)
        batch = next(v.aval.shape[0] for v, role in roles if role == "batch")
        return _measure.Timing.of([costs[layer][batch]] * 4)

    monkeypatch.setattr(_table, "measure_layer", measure_layer)
    monkeypatch.setattr(_table, "measure_layers", lambda *a, **k: None)


def test_measured_fixed_part_per_microbatch(monkeypatch):
    known_layer_times(monkeypatch)
    table = zoo.cost_table("mlp", ["cpu:0"], small=True, measure=True, k=2, microbatches=2)
    assert [layer.name for layer in table.layers] == list(KNOWN_FIXED)
    for layer in table.layers:
        assert layer.time_s["cpu:0"] == pytest.approx(KNOWN_COSTS[layer.name][4])
        assert layer.fixed_s == {"cpu:0": pytest.approx(KNOWN_FIXED[layer.name], abs=1e-12)}
    assert "batch/2" in table.meta["fixed_s"]
    assert CostTable.from_json(table.to_json()).layers == table.layers

    with pytest.raises(ProfileError, match="pass measure=True"):
        zoo.cost_table("mlp", ["cpu:0"], small=True, microbatches=2)
    with pytest.raises(ProfileError, match="positive integer"):
        zoo.cost_table("mlp", ["cpu:0"], small=True, measure=True, microbatches=0)
    with pytest.raises(ProfileError, match="does not divide"):
        zoo.cost_table("mlp", ["cpu:0"], small=True, measure=True, microbatches=7)


def test_scale_to_step_scales_the_fixed_part_too():
    import dataclasses

    from hetpar.cost_models import scale_to_step

    table = zoo.cost_table("mlp", ["cpu:0"], small=True)
    table = dataclasses.replace(table, layers=tuple(
        dataclasses.replace(layer, fixed_s={"cpu:0": 0.5 * layer.time_s["cpu:0"]})
        for layer in table.layers))
    total = sum(layer.time_s["cpu:0"] for layer in table.layers)
    scaled = scale_to_step(table, {"cpu:0": total / 4})  # validated on the way
    for layer in scaled.layers:
        assert layer.fixed_s["cpu:0"] == pytest.approx(0.5 * layer.time_s["cpu:0"])


def test_scale_to_step_carries_a_measured_factor_to_siblings():
    # Plan for an H100 from an H200 host: the H200's measured step scales the
    # H100's layers too (their per-layer ratio kept); the CPU is left alone.
    from hetpar.cost_models import scale_to_step

    table = zoo.cost_table("mlp", ["cpu:0", "h100", "h200"], small=True)
    total = {d: sum(layer.time_s[d] for layer in table.layers) for d in ("h100:0", "h200:0")}
    alone = scale_to_step(table, {"h200:0": 2 * total["h200:0"]})
    assert alone.layers[0].time_s["h100:0"] == table.layers[0].time_s["h100:0"]
    scaled = scale_to_step(table, {"h200:0": 2 * total["h200:0"]}, siblings=True)
    assert scaled.meta["step_scale_from"] == {"h100:0": "h200:0"}
    for before, after in zip(table.layers, scaled.layers):
        assert after.time_s["h100:0"] == pytest.approx(2 * before.time_s["h100:0"])
        assert after.time_s["cpu:0"] == before.time_s["cpu:0"]
        assert after.time_s["h100:0"] / after.time_s["h200:0"] == pytest.approx(
            before.time_s["h100:0"] / before.time_s["h200:0"])


def test_timed_step_carries_the_runtimes_costs_to_the_table():
    # profile="measure" times the runtime's cost per stage and per crossing on
    # the present devices (here on the real runtime, cpu:0 and cpu:1): each
    # present device takes its kind's, a sibling of its class would borrow it,
    # the present devices' links are raised to the measured crossing and take
    # the bandwidth measured at the plan's sizes.
    import jax

    from hetpar.runtime import crossing_s, link_bandwidth, stage_overhead_s

    table = zoo.cost_table("mlp", ["cpu:0", "cpu:1", "h100"], small=True)
    present = {f"cpu:{d.id}": d for d in jax.devices("cpu")[:2]}
    calls = []

    def overhead(name, dev):
        calls.append(name)
        return stage_overhead_s(name, dev, runs=5)

    scaled = cost_models.scale_to_timed_step(
        table, present, lambda name, dev: 1.0, overhead,
        lambda a, b, both: crossing_s(a, b, both, runs=5),
        lambda src, dst, n: link_bandwidth(src, dst, n, runs=3))
    assert calls == ["cpu:0"]  # once per kind
    per = scaled.meta["stage_overhead_s"]
    # (0 where the split chain ran no slower than one executable: a loaded 2-core box)
    assert set(per) == {"cpu:0", "cpu:1"} and 0 <= per["cpu:0"] == per["cpu:1"] < 1.0
    assert scaled.device("cpu:1").stage_overhead_s == per["cpu:0"]
    assert scaled.device("h100:0").stage_overhead_s == 0.0  # another class: nothing measured
    cross = scaled.meta["crossing_s"]["cpu/cpu"]
    assert 0 <= cross < 1.0  # (0 where the split chain ran no slower: a loaded box)
    link = {(k.src, k.dst): k for k in scaled.links}
    wire = {(k.src, k.dst): k for k in table.links}["cpu:0", "cpu:1"].latency_s  # 5 us
    # The runtime's handoff where it exceeds the wire's latency.
    assert link["cpu:0", "cpu:1"].latency_s == max(cross, wire)
    assert link["cpu:0", "h100:0"] == {(k.src, k.dst): k for k in table.links}["cpu:0", "h100:0"]
    # The copy's bandwidth at the sizes the step passes between layers (a
    # byte-weighted median); a host <-> accelerator link's sizes include the
    # weights and optimizer state offload moves.
    edges = sorted(b for e in table.edges for b in (e.bytes, e.bytes_backward) if b > 0)
    at = scaled.meta["bandwidth_at_bytes"]
    assert at["cpu->cpu"] in edges
    assert sum(b for b in edges if b <= at["cpu->cpu"]) >= sum(edges) / 2
    assert sum(b for b in edges if b < at["cpu->cpu"]) < sum(edges) / 2
    assert cost_models._calibrate_table._copy_size(table, "cpu", "h100") >= at["cpu->cpu"]
    bw = scaled.meta["bandwidth_bytes_per_s"]["cpu->cpu"]
    assert bw > 0 and link["cpu:0", "cpu:1"].bandwidth_bytes_per_s == bw
    assert link["cpu:1", "cpu:0"].bandwidth_bytes_per_s == bw  # one kind: one figure each way


def test_timed_step_takes_measured_link_curves():
    # profile="measure" times the engine's copies at the sizes a link may
    # carry (here between two virtual CPU devices; from 1 MB): the links
    # between present devices take the curve, and a bandwidth read off it at
    # the byte-weighted median size; others keep theirs.
    import jax

    from hetpar.runtime import link_curve

    table = zoo.cost_table("mlp", ["cpu:0", "cpu:1", "h100"], small=True)
    present = {f"cpu:{d.id}": d for d in jax.devices("cpu")[:2]}
    asked = []

    def curve(src, dst, sizes):
        asked.append(sizes)
        # The MLP's copies are all priced at 1 MB against a 4 kB one; on a
        # loaded machine the two can time alike, and link_curve then gives
        # None (the link keeps its figure: once in eight suite runs). Again.
        for _ in range(5):
            got = link_curve(src, dst, sizes, runs=3)
            if got:
                break
        return got

    scaled = cost_models.scale_to_timed_step(table, present, lambda name, dev: 1.0,
                                             lambda name, dev: 1e-4, curve=curve)
    sizes = cost_models._calibrate_table._copy_sizes(table, "cpu", "cpu")
    assert asked == [sizes]  # one way per pair of kinds: cpu -> cpu
    link = {(k.src, k.dst): k for k in scaled.links}
    points = link["cpu:0", "cpu:1"].curve
    assert points and points == link["cpu:1", "cpu:0"].curve
    assert points[0][0] == 1 << 20 and all(t >= 0 for _, t in points)
    at = [b for b, _ in points]
    wanted = {1 << 20} | {4 * min(max(int(b) // 4, 1 << 18), 1 << 26) for b in sizes}
    assert set(at) <= wanted and at == sorted(at)
    assert all(min(abs(b / a - 1) for a in at) <= 0.02 for b in wanted)  # each size near a point
    at = scaled.meta["bandwidth_at_bytes"]["cpu->cpu"]
    assert link["cpu:0", "cpu:1"].bandwidth_bytes_per_s == pytest.approx(
        at / link["cpu:0", "cpu:1"].copy_s(at))
    assert scaled.meta["link_curves"]["cpu->cpu"] == [list(p) for p in points]
    assert not link["cpu:0", "h100:0"].curve  # a spec-sheet device's link: as it was


def test_measured_layers_carry_to_a_spec_sheet_sibling():
    # With measure=True, a spec-sheet GPU beside a measured one gets the measured
    # time x their predicted ratio; a class nothing measured keeps its roofline.
    from hetpar.cost_models import spec
    from hetpar.cost_models._resolve import ResolvedDevice
    from hetpar.cost_models._table import _from_siblings

    devs = [ResolvedDevice(n, spec(k).replace(name=n), None)
            for n, k in (("cpu:0", "cpu"), ("gpu:0", "h200"), ("h100:0", "h100"))]
    predicted = {"cpu:0": 9.0, "gpu:0": 1.0, "h100:0": 1.5}
    assert _from_siblings(devs, {"gpu:0": 4.0}, predicted) == {"h100:0": 6.0}
    assert _from_siblings(devs, {"cpu:0": 4.0}, predicted) == {}


def test_calibrate_times_the_whole_step_on_present_devices():
    table = zoo.cost_table("mlp", ["cpu:0", "h100"], small=True, calibrate=True, k=2)
    step = table.meta["step_s"]["cpu:0"]
    assert sum(layer.time_s["cpu:0"] for layer in table.layers) == pytest.approx(step)
    assert "h100:0" not in table.meta["step_scale"]  # no measured GPU to follow
    with pytest.raises(ProfileError, match="none of .* is present"):
        zoo.cost_table("mlp", ["h100"], small=True, calibrate=True, k=2)


def test_replica_fixed_part_from_the_data_parallel_step():
    # With two or more timed devices of a kind (data parallel possible), the
    # step run data parallel over two of them, less the gradients' all-reduce
    # as the links price it, is one replica's step: (1 - f) T / 2 + f T.
    # Layers without their own fixed part take the fraction f of their time;
    # the data-parallel prediction is then the step measured.
    import dataclasses

    import jax

    from hetpar.core import ring_allreduce_s
    from hetpar.planner import evaluate_data_parallel

    table = zoo.cost_table("mlp", ["cpu:0", "cpu:1", "h100"], small=True)
    mine = table.layer_names[0]  # keeps the fixed part it has
    # Updates of 10% of each layer's time (spec sheets make a small MLP's nearly all update).
    table = dataclasses.replace(table, layers=tuple(
        dataclasses.replace(la, update_s={d: 0.1 * t for d, t in la.time_s.items()},
                            fixed_s={"cpu:0": 0.0, "cpu:1": 0.0} if la.name == mine else None)
        for la in table.layers))
    present = {f"cpu:{d.id}": d for d in jax.devices("cpu")[:2]}
    link = next(k for k in table.links if (k.src, k.dst) == ("cpu:0", "cpu:1"))
    allreduce = ring_allreduce_s(sum(la.param_bytes for la in table.layers), 2,
                                 link.bandwidth_bytes_per_s, link.latency_s)
    asked = []

    def replicas(names, devs):
        asked.append(names)
        assert devs == [present[n] for n in names]
        return 1.4 + allreduce  # both replicas' 0.7 s of T = 1 s

    plain = cost_models.scale_to_timed_step(table, present, lambda name, dev: 1.0)
    scaled = cost_models.scale_to_timed_step(table, present, lambda name, dev: 1.0,
                                             time_replicas=replicas)
    assert asked == [["cpu:0", "cpu:1"]]  # once per kind
    frac = scaled.meta["fixed_fraction"]
    assert set(frac) == {"cpu:0", "cpu:1"} and 0.4 < frac["cpu:0"] == frac["cpu:1"] < 1.0
    frac = frac["cpu:0"]  # over 0.4: the first layer keeps its own fixed part of 0
    assert scaled.meta["replicated_step_s"] == {"cpu:0 cpu:1": pytest.approx(1.4 + allreduce)}
    for layer in scaled.layers:
        for d in ("cpu:0", "cpu:1"):
            # The measured part holds the update, which data parallel charges apart.
            update = (layer.update_s or {}).get(d, 0.0)
            want = 0.0 if layer.name == mine else max(0.0, frac * layer.time_s[d] - update)
            assert layer.fixed_s[d] == pytest.approx(want)
            if layer.name != mine:  # with the update: the measured fraction
                assert layer.fixed_s[d] + update == pytest.approx(frac * layer.time_s[d])
        assert "h100:0" not in layer.fixed_s  # another class: nothing measured
    dp = {t.meta.get("fixed_fraction") is not None:
          evaluate_data_parallel(t, ["cpu:0", "cpu:1"]).step_time_s for t in (plain, scaled)}
    assert dp[True] > dp[False]
    # The planner's closed form then gives the step measured: here the two
    # devices share a compute group (one process's cores), so their replicas'
    # work adds up, and the measured step holds both.
    assert table.device("cpu:0").compute_group == table.device("cpu:1").compute_group
    for measured in (1.2, 1.4):  # (within both replicas' work at f = 0 and at f = 1)
        t = cost_models.scale_to_timed_step(table, present, lambda name, dev: 1.0,
                                            time_replicas=lambda *_, m=measured: m + allreduce)
        assert evaluate_data_parallel(t, ["cpu:0", "cpu:1"]).step_time_s == pytest.approx(
            measured + allreduce, rel=1e-6)
    # Apart (two GPUs), a replica's step is the measured one less the all-reduce.
    apart = dataclasses.replace(table, devices=tuple(
        dataclasses.replace(d, compute_group=None) for d in table.devices))
    big = dataclasses.replace(apart, layers=tuple(  # updates of half the time: f floored
        dataclasses.replace(la, update_s={d: 0.5 * t for d, t in la.time_s.items()})
        for la in apart.layers))
    for tab, measured in ((apart, 0.7), (apart, 0.55), (big, 0.8)):
        t = cost_models.scale_to_timed_step(tab, present, lambda name, dev: 1.0,
                                            time_replicas=lambda *_, m=measured: m + allreduce)
        assert evaluate_data_parallel(t, ["cpu:0", "cpu:1"]).step_time_s == pytest.approx(
            measured + allreduce, rel=1e-6)
    # Every layer with fixed parts of its own (measured per microbatch): nothing asked.
    asked.clear()
    own = dataclasses.replace(table, layers=tuple(
        dataclasses.replace(la, fixed_s={"cpu:0": 0.0, "cpu:1": 0.0}) for la in table.layers))
    cost_models.scale_to_timed_step(own, present, lambda name, dev: 1.0, time_replicas=replicas)
    assert asked == []
    # Fewer than two devices of the kind: no data parallel, nothing asked.
    asked.clear()
    one = cost_models.scale_to_timed_step(table, {"cpu:0": present["cpu:0"]},
                                          lambda name, dev: 1.0, time_replicas=replicas)
    assert asked == [] and "fixed_fraction" not in one.meta


def test_measure_step_runs_data_parallel_over_several_devices():
    # A list of devices: the state replicated, the batch split, as Replicated
    # runs it; the results equal one device's.
    import jax
    import jax.numpy as jnp
    import numpy as np

    seen = []

    def step(w, x):
        jax.debug.callback(lambda part: seen.append(part.shape[0]), x, partitioned=True)
        return w - 0.1 * jnp.mean(x, axis=0) @ w, jnp.sum(w)

    devs = jax.devices("cpu")[:2]
    w, x = jnp.eye(3), np.arange(24, dtype=np.float32).reshape(8, 3)
    t = cost_models.measure_step(step, (w, x), devs, k=2, warmup=1)
    assert t.median_s > 0 and len(t.samples) == 2
    assert set(seen) == {4}  # each replica has half the batch
    with pytest.raises(ProfileError, match=r"shape \(8, 3\) does not split over 3 replicas"):
        cost_models.measure_step(step, (w, x), jax.devices("cpu")[:3], k=1)


def test_measure_step_over_replicas_leaves_an_uncommitted_batch_to_jit(monkeypatch):
    # hetpar's data-parallel step hands an uncommitted batch (made with jnp) to
    # jit, which lays it out every call; calibration must time that, not a
    # batch split once (GPT-2 b64 on 2x H200 predicted 34 ms, ran 39 ms).
    import jax
    import jax.numpy as jnp

    put, real = [], jax.device_put

    def recording(x, *a, **k):
        put.extend(map(id, jax.tree_util.tree_leaves(x)))
        return real(x, *a, **k)

    monkeypatch.setattr(jax, "device_put", recording)

    def step(w, x):
        return w - 0.1 * jnp.mean(x, axis=0) @ w, jnp.sum(w)

    devs = jax.devices("cpu")[:2]
    w, x = jnp.eye(3), jnp.ones((8, 3))
    assert not x.committed
    cost_models.measure_step(step, (w, x), devs, k=1, warmup=1)
    assert id(x) not in put
    on_one = real(x, devs[1])  # committed to one replica: put split, once
    cost_models.measure_step(step, (w, on_one), devs, k=1, warmup=1)
    assert id(on_one) in put
    put.clear()
    cost_models.measure_step(step, (w, x), devs[0], k=1, warmup=1)  # one device: put once
    assert id(x) in put


def test_measure_step_threads_the_state_and_keeps_the_batch_as_given():
    import jax
    import numpy as np

    seen = []

    def step(w, batch):
        jax.debug.callback(lambda v: seen.append(float(v)), w.sum())
        return w - 1.0, (batch * w).sum()

    w, batch = np.zeros(3, np.float32), np.ones(3, np.float32)
    t = cost_models.measure_step(step, (w, batch), "cpu:0", k=4, warmup=2)
    assert len(t.samples) == 4 and t.median_s > 0
    # Compiling run, warm-up, one untimed threaded run, 4 timed: each on the last one's outputs.
    assert seen == [0.0, -3.0, -6.0, -9.0, -12.0, -15.0, -18.0]
    assert (w == 0).all()  # the caller's arrays are untouched
    # Outputs that are not the state: every run takes the same arguments.
    seen.clear()
    cost_models.measure_step(lambda w, b: step(w, b)[1], (w, batch), "cpu:0", k=2, warmup=1)
    assert seen == [0.0, 0.0, 0.0]
    # Only outputs that match a state argument exactly are threaded: a loss is
    # not fed back as a learning rate passed as a Python float.
    rates = []

    def sgd(w, lr, batch):
        jax.debug.callback(lambda v: rates.append(float(v)), lr)
        return w - lr * batch, (batch * w).sum()

    cost_models.measure_step(sgd, (w, 0.5, batch), "cpu:0", k=2, warmup=1)
    assert rates == [0.5] * len(rates) and len(rates) == 4
    # Where threading fails (out of memory holding one more state), every run
    # takes the same arguments.
    seen.clear()

    def fragile(w, batch):
        def check(v):
            seen.append(float(v))
            if v < -4:
                raise RuntimeError("RESOURCE_EXHAUSTED (a stand-in)")
        jax.debug.callback(check, w.sum())
        return w - 1.0, (batch * w).sum()

    t = cost_models.measure_step(fragile, (w, batch), "cpu:0", k=2, warmup=1)
    assert len(t.samples) == 2 and seen[-2:] == [0.0, 0.0]
    # A batch committed to another device is moved, as the state is.
    elsewhere = jax.device_put(batch, jax.devices("cpu")[1])
    assert cost_models.measure_step(step, (w, elsewhere), "cpu:0", k=1).median_s > 0
    with pytest.raises(ProfileError, match="k must be"):
        cost_models.measure_step(step, (w, batch), "cpu:0", k=0)


def test_batch_share_cuts_each_batch_leaf():
    import numpy as np

    args = (np.zeros(4), {"x": np.arange(8).reshape(8, 1), "y": np.arange(8)})
    half = cost_models.batch_share(args, (-1,), 2)
    assert half[0] is args[0]
    assert half[1]["x"].shape == (4, 1) and list(half[1]["y"]) == [0, 1, 2, 3]
    assert cost_models.batch_share(args, (-1,), 3) is None  # 8 rows do not split in 3
    # A scalar in the batch goes to every replica whole.
    mixed = cost_models.batch_share((np.zeros(4), (np.arange(8), 0.1)), (-1,), 2)
    assert list(mixed[1][0]) == [0, 1, 2, 3] and mixed[1][1] == 0.1
    assert cost_models.batch_share((np.zeros(4), 0.1), (-1,), 2) is None  # nothing to cut


def _one_far_slower():
    # cpu:0 as the CPU spec sheet says; cpu:1 profiled as another kind (a T4)
    # with a launch 10^4 times dearer: the host CPU beside a GPU, inverted
    # and in miniature.
    from hetpar.cost_models import ProfileSet, spec, spec_kinds

    base = spec("cpu")
    return ProfileSet({**{k: spec(k) for k in spec_kinds()},
                       "cpu:0": base.replace(name="cpu:0", origin="measured"),
                       "cpu:1": base.replace(name="cpu:1", kind="t4", origin="measured",
                                             launch_overhead_s=base.launch_overhead_s * 1e4)})


def test_measure_leaves_a_far_slower_device_predicted(monkeypatch):
    # GPT-2 at batch 256 on an H200 host: timing every layer on the host CPU
    # too took minutes, for a device the plan then left without layers.
    from hetpar.cost_models import _table

    _, graph = _lm()
    profiles = _one_far_slower()
    timed, together = [], []
    real = _table.measure_layer
    monkeypatch.setattr(_table, "measure_layer",
                        lambda g, name, dev, **kw: timed.append(dev.id) or real(g, name, dev, **kw))
    real_together = _table.measure_layers

    def timing_together(g, names, dev, **kw):
        if not kw.get("update"):  # the layers' stages, not their updates
            together.append((dev.id, list(names)))
        return real_together(g, names, dev, **kw)

    monkeypatch.setattr(_table, "measure_layers", timing_together)
    budget = cost_models.TimingBudget(floor_s=0.0)
    table = cost_models.cost_table(graph, ["cpu:0", "cpu:1"], profiles=profiles,
                                   measure=True, k=2, budget=budget)
    assert timed == [0] * len(graph.layers)  # cpu:0's layers only
    assert together == [(0, list(graph.layers))]  # timed together first, by the same budget
    assert table.meta["kept_predicted"] == {name: ["cpu:1"] for name in graph.layers}
    for layer in table.layers:
        measured, predicted = (table.meta[k][layer.name] for k in ("measured_s", "predicted_s"))
        assert set(measured) == {"cpu:0"} and layer.time_s["cpu:0"] == measured["cpu:0"]
        assert layer.time_s["cpu:1"] == predicted["cpu:1"]
    # A pair a plan computes on is timed whatever the budget says.
    first = graph.layers[0]
    timed.clear()
    again = cost_models.cost_table(
        graph, ["cpu:0", "cpu:1"], profiles=profiles, measure=True, k=2,
        budget=cost_models.TimingBudget(floor_s=0.0, timed=frozenset({(first, "cpu:1")})))
    assert sorted(timed) == [0] * len(graph.layers) + [1]
    assert first not in again.meta["kept_predicted"]
    assert set(again.meta["measured_s"][first]) == {"cpu:0", "cpu:1"}
    # Over the floor only: under a floor of 10 s a run, both are timed.
    timed.clear()
    both = cost_models.cost_table(graph, ["cpu:0", "cpu:1"], profiles=profiles, measure=True,
                                  k=2, budget=cost_models.TimingBudget(floor_s=10.0))
    assert sorted(timed) == sorted([0, 1] * len(graph.layers))
    assert "kept_predicted" not in both.meta


def test_measure_times_every_device_of_the_fastest_kind(monkeypatch):
    # Devices of one kind are never left untimed, however their profiles differ.
    from hetpar.cost_models import ProfileSet, spec, spec_kinds

    _, graph = _lm()
    base = spec("cpu")
    profiles = ProfileSet({**{k: spec(k) for k in spec_kinds()},
                           "cpu:0": base.replace(name="cpu:0", origin="measured"),
                           "cpu:1": base.replace(name="cpu:1", origin="measured",
                                                 launch_overhead_s=base.launch_overhead_s * 1e4)})
    table = cost_models.cost_table(graph, ["cpu:0", "cpu:1"], profiles=profiles, measure=True,
                                   k=2, budget=cost_models.TimingBudget(floor_s=0.0))
    assert "kept_predicted" not in table.meta
    assert all(set(v) == {"cpu:0", "cpu:1"} for v in table.meta["measured_s"].values())


def test_timed_step_leaves_a_far_slower_kind_predicted():
    import jax

    _, graph = _lm()
    table = cost_models.cost_table(graph, ["cpu:0", "cpu:1"], profiles=_one_far_slower())
    present = {f"cpu:{d.id}": d for d in jax.devices("cpu")[:2]}
    asked, stages = [], []

    def time_step(name, dev):
        asked.append(name)
        return 1.0

    def overhead(name, dev):
        stages.append(name)
        return 1e-4

    budget = cost_models.TimingBudget(step_floor_s=0.0)
    scaled = cost_models.scale_to_timed_step(table, present, time_step, overhead, budget=budget)
    assert asked == ["cpu:0"] and scaled.meta["untimed_kinds"] == ["t4"]
    assert scaled.meta["step_s"] == {"cpu:0": 1.0}
    assert sum(la.time_s["cpu:0"] for la in scaled.layers) == pytest.approx(1.0)
    assert [la.time_s["cpu:1"] for la in scaled.layers] == [
        la.time_s["cpu:1"] for la in table.layers]
    # Its runtime costs are still measured: the offload planner prices its links.
    assert stages == ["cpu:0", "cpu:1"]
    assert scaled.device("cpu:1").stage_overhead_s == 1e-4
    # The fast kind could not run the step (out of memory): still not timed there.
    asked.clear()
    none = cost_models.scale_to_timed_step(table, present, lambda n, d: asked.append(n),
                                           budget=budget)
    assert asked == ["cpu:0"] and none.meta["untimed_kinds"] == ["t4"]
    asked.clear()
    cost_models.scale_to_timed_step(table, present, time_step, budget=None)
    assert asked == ["cpu:0", "cpu:1"]
    # Asked for (`steps`: a plan spends most of its step there), but one run
    # over the ceiling: not timed, and no later round asks again.
    slow_step = sum(la.time_s["cpu:1"] for la in table.layers)
    for ceiling, want in ((2 * slow_step, ["cpu:0", "cpu:1"]), (slow_step / 2, ["cpu:0"])):
        asked.clear()
        t = cost_models.scale_to_timed_step(
            table, present, time_step, budget=cost_models.TimingBudget(
                step_floor_s=0.0, steps=frozenset({"t4"}), step_ceiling_s=ceiling))
        assert asked == want
    assert t.meta["untimable_kinds"] == ["t4"]


def test_links_are_measured_where_no_whole_step_is_timed():
    """An offload plan's case: no device can hold the step alone (`fits`;
    on an H200 host, the GPU too small and its CPU far slower), so no whole
    step runs; the runtime's costs between the devices are still measured
    and priced. Left at the spec sheet's, a 0.54B model's plan on a 7.5 GB
    H200 predicted 272 ms and ran 1265 ms, its gradients crossing to the
    host CPU at a fraction of the 63 GB/s the table said."""
    import jax

    _, graph = _lm()
    table = cost_models.cost_table(graph, ["cpu:0", "cpu:1"])
    present = {f"cpu:{d.id}": d for d in jax.devices("cpu")[:2]}
    asked = []
    scaled = cost_models.scale_to_timed_step(
        table, present, lambda name, dev: asked.append(name) or 1.0,
        lambda name, dev: 1e-4, crossing=lambda a, b, both: 2e-3,
        bandwidth=lambda src, dst, at: 1e9, fits=lambda name: False)
    assert asked == []  # no whole step ran
    assert scaled.meta["untimed_kinds"] == ["cpu"]
    assert "step_s" not in scaled.meta
    assert [la.time_s for la in scaled.layers] == [la.time_s for la in table.layers]
    link = {(k.src, k.dst): k for k in scaled.links}
    for way in (("cpu:0", "cpu:1"), ("cpu:1", "cpu:0")):
        assert link[way].latency_s == pytest.approx(2e-3)
        assert link[way].bandwidth_bytes_per_s == pytest.approx(1e9)
    assert scaled.device("cpu:0").stage_overhead_s == scaled.device("cpu:1").stage_overhead_s \
        == 1e-4


@pytest.mark.parametrize("kw", [dict(slower=0.5), dict(floor_s=-1.0), dict(step_floor_s=-0.1),
                                dict(slower=float("nan")), dict(step_ceiling_s=0.0)])
def test_timing_budget_rejects_what_would_skip_the_fastest_or_everything(kw):
    with pytest.raises(ProfileError, match="budget=None"):
        cost_models.TimingBudget(**kw)


def test_measure_update_times_the_optimizer_update_alone():
    # The offload planner's host updates stand on update_s: timed alone, an
    # executable of the layer's update equations (Adam's, here) on random inputs.
    from hetpar.cost_models import measure_update
    from hetpar.cost_models._layer_timing import update_eqns

    _, graph = _lm()
    assert graph.layers[0] == "vectorize"  # no parameters, no update
    assert measure_update(graph, "vectorize", "cpu:0") is None
    layer = "embedding"
    ids = update_eqns(graph, layer)
    assert ids and set(ids) < set(graph[layer].eqns)
    t = measure_update(graph, layer, "cpu:0", k=3)
    assert t.median_s > 0 and not t.cached
    assert measure_update(graph, layer, "cpu:0", k=3).cached  # keyed apart from the layer
    assert cost_models.measure_layer(graph, layer, "cpu:0", k=3).cached is False


def test_timing_budget_steps_is_a_set_of_kinds():
    # A bare string would match kinds by substring ("cpu" in "cpu" but also "c").
    with pytest.raises(ProfileError, match="steps is a set of device kinds"):
        cost_models.TimingBudget(steps="cpu")
    assert cost_models.TimingBudget(steps={"cpu"}).steps == frozenset({"cpu"})


def test_link_curve_times_the_sizes_the_link_carries():
    # At most `most` of the distinct sizes, evenly by rank, the smallest and
    # the largest kept, and 1 MB; each point's seconds beyond a 4 kB copy.
    import jax

    from hetpar.runtime import link_curve

    a, b = jax.devices("cpu")[:2]
    sizes = [k * 1e6 for k in range(2, 21)] + [2e6, 3e5]  # repeats and a small one
    # Three runs each: one 4 kB copy slowed by a loaded box (CI's two cores)
    # could outlast every larger one, and the curve would be None.
    points = link_curve(a, b, sizes, runs=3, most=5)
    at = [p[0] for p in points]
    assert len(at) == 5 and at[0] == 1 << 20 and at[-1] == 4 * (int(20e6) // 4)
    near = link_curve(a, b, [8e6, 8.1e6, 12e6], runs=3)  # 8.1 MB is 8 MB's point
    assert [p[0] for p in near] == [1 << 20, 4 * (int(8e6) // 4), 4 * (int(12e6) // 4)]
    assert at == sorted(at) and all(t >= 0 for _, t in points)
    took = [t for _, t in points]
    assert took == sorted(took)  # a larger copy never prices cheaper


def test_random_inputs_past_the_drawn_size_repeat_their_draw():
    # A layer's timing inputs are drawn up to DRAWN values and repeated past
    # it (drawing a 6.7B model's block took 16 s at the first call), integers
    # as floats.
    import jax
    import jax.numpy as jnp

    from hetpar.cost_models import _layer_timing
    from hetpar.passes import trace

    n = _layer_timing.DRAWN + 7
    table = jnp.ones((8, 4))

    def step(w, ids):
        return jnp.sum(w * 2.0) + jnp.sum(table[ids])

    graph = trace(step, jax.ShapeDtypeStruct((n,), jnp.float32),
                  jax.ShapeDtypeStruct((n,), jnp.int32))
    drawn = {}
    for layer in graph.layers:
        for v, x in zip(graph.layer_jaxpr(layer)[0].jaxpr.invars,
                        cost_models.random_inputs(graph, layer)[1], strict=True):
            if getattr(x, "shape", None) == (n,):
                drawn[str(v.aval.dtype)] = np.asarray(x)
    w, ids = drawn["float32"], drawn["int32"]
    assert 0.9 < w[:1000].std() < 1.1 and len(np.unique(w[:1000])) == 1000
    np.testing.assert_array_equal(w[_layer_timing.DRAWN:], w[:7])
    assert ids.min() >= 0 and ids.max() < 128  # unbounded indices: below 128
    np.testing.assert_array_equal(ids[_layer_timing.DRAWN:], ids[:7])


def test_measure_step_holds_two_states_on_the_device_when_the_callers_is_elsewhere():
    # Threaded runs take the last run's state: the copy measure_step put on
    # the device goes once the first run replaced it, and only the caller's
    # arrays (here on another device) are kept for a fallback. Held, a
    # step's 35 GB state peaked at 106 GB while calibrating on a 113 GB
    # H200, where the step itself peaks at 50 (fit_h200, run 66).
    import jax
    import jax.numpy as jnp

    host, dev = jax.devices("cpu")[:2]
    shape = (123, 457)  # the state's own shape: nothing else has it
    w = jax.device_put(jnp.ones(shape), host)
    x = jnp.ones((4, 123))

    def on_dev() -> int:
        return sum(1 for a in jax.live_arrays() if a.shape == shape and not a.is_deleted()
                   and dev in a.devices())

    held = []
    real = jax.jit(lambda w, x: (w - 1e-3 * jnp.sum(x), jnp.sum(w)))  # (state, loss)

    def jitted(*args):
        held.append(on_dev())  # what the device holds as a run starts: its inputs
        return real(*args)

    t = cost_models.measure_step(None, (w, x), dev, k=3, warmup=2, jitted=jitted)
    assert t.median_s > 0
    assert held and max(held) == 1, held  # never its own copy beside the last run's
    assert not w.is_deleted() and w.devices() == {host}


def test_measure_step_times_a_donating_jit_on_copies_of_its_own():
    # The executable the run donates with, timed on the caller's arrays,
    # would give them up: each run takes a copy of its own, the last run's
    # outputs where the step returns its state, else a fresh copy put
    # before the run; a donated batch is refused.
    import jax
    import jax.numpy as jnp

    dev = jax.devices("cpu")[0]
    w, x = jax.device_put(jnp.ones((64, 64)), dev), jax.device_put(jnp.ones((8, 64)), dev)
    threaded = jax.jit(lambda w, x: (w - 1e-3 * jnp.sum(x), jnp.sum(w)), donate_argnums=0)
    returned_last = jax.jit(lambda w, x: (jnp.sum(w), w - 1e-3), donate_argnums=0)
    for jitted in (threaded, returned_last):
        t = cost_models.measure_step(None, (w, x), dev, k=3, warmup=1, jitted=jitted,
                                     donated=(0,))
        assert len(t.samples) == 3 and t.median_s > 0
        assert not w.is_deleted() and not x.is_deleted()
    with pytest.raises(ProfileError, match="donated batch"):
        cost_models.measure_step(None, (w, x), dev, k=1, jitted=threaded, donated=(0, 1))
    assert not x.is_deleted()
