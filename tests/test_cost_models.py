"""Cost models: profiles, spec sheets, roofline calibration, measurement, `hetpar profile`."""

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetpar import ProfileError
from hetpar.core import Link
from hetpar.cost_models import (
    OP_CLASSES,
    DeviceProfile,
    LayerWork,
    LinkProfile,
    ProfileSet,
    Timing,
    calibrate,
    fit_link,
    load_profiles,
    measure,
    measure_cached,
    plan_prices,
    predict,
    save_profiles,
    spec,
    spec_kinds,
    sweep_batch,
    transfer_calibration,
)

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_every_spec_sheet_loads_and_cites_every_figure():
    assert {"cpu", "t4", "a100", "h100", "h200", "tpu-v4", "tpu-v5e"} <= set(spec_kinds())
    for kind in spec_kinds():
        p = spec(kind)
        assert p.name == p.kind == kind
        for key in [f"peak_flops_per_s.{d}" for d in p.peak_flops_per_s] + [
            "memory_bandwidth_bytes_per_s", "memory_bytes", "price_per_hour", "efficiencies"
        ]:
            assert p.sources[key], (kind, key)
    h100 = spec("h100")
    assert h100.peak_flops_per_s["bf16"] == pytest.approx(989.4e12)
    assert h100.memory_bandwidth_bytes_per_s == pytest.approx(3.35e12)
    assert spec("h200").memory_bytes == pytest.approx(141e9)


def test_profile_json_round_trip(tmp_path):
    links = (LinkProfile("cpu:0", "gpu:0", "pinned_host", 2e-5, 8e9, "test", ((4096.0, 2.1e-5),)),)
    ps = ProfileSet({"h100": spec("h100"), "cpu": spec("cpu")}, links, {"host": "x"})
    path = tmp_path / "p.json"
    save_profiles(path, ps)
    back = ProfileSet.from_json(json.loads(path.read_text()))
    assert back == ps
    assert load_profiles(path).devices["h100"] == spec("h100")


def _file_with(device: dict, **top) -> dict:
    return {"format": "hetpar.profiles", "version": 1, "devices": [device], "links": []} | top


def test_missing_field_is_named(tmp_path):
    d = spec("a100").to_json()
    del d["memory_bandwidth_bytes_per_s"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_file_with(d)))
    with pytest.raises(ProfileError, match="memory_bandwidth_bytes_per_s"):
        load_profiles(path)


def test_figure_without_source_and_efficiency_above_one_are_rejected():
    d = spec("t4").to_json()
    del d["sources"]["price_per_hour"]
    with pytest.raises(ProfileError, match="price_per_hour.*no source"):
        DeviceProfile.from_json(d)
    d = spec("t4").to_json()
    d["efficiencies"]["matmul"]["flops"] = 1.5
    with pytest.raises(ProfileError, match="efficiencies.matmul.flops"):
        DeviceProfile.from_json(d)


def test_unknown_version_and_unknown_kind():
    with pytest.raises(ProfileError, match="unknown version 7"):
        ProfileSet.from_json(_file_with(spec("cpu").to_json(), version=7))
    with pytest.raises(ProfileError, match="unknown device kind 'h900'.*h100"):
        spec("h900")
    with pytest.raises(ProfileError, match="h900"):
        load_profiles().device("h900")


def test_host_cpu_is_free_next_to_an_accelerator():
    cpu, gpu = spec("cpu"), spec("h100")
    assert plan_prices([cpu, gpu]) == {"cpu": 0.0, "h100": gpu.price_per_hour}
    assert plan_prices([cpu]) == {"cpu": cpu.price_per_hour}
    assert plan_prices([cpu, gpu], host_cpu_included=False)["cpu"] == cpu.price_per_hour


def _work(rng, cls="matmul"):
    return LayerWork(
        {cls: float(rng.uniform(1e9, 1e12))},
        {cls: float(rng.uniform(1e6, 1e10))},
        launches=int(rng.integers(1, 4)),
    )


def test_calibration_recovers_known_efficiencies():
    rng = np.random.default_rng(0)
    base = spec("h100")
    truth = {
        "matmul": {"flops": 0.62, "bytes": 0.81},
        "elementwise": {"flops": 0.35, "bytes": 0.7},
        "reduction": {"flops": 0.2, "bytes": 0.45},
        "other": {"flops": 0.1, "bytes": 0.3},
    }
    true_prof = base.replace(efficiencies=truth)
    samples = []
    for _ in range(30):
        for cls in OP_CLASSES:
            w = _work(rng, cls)
            samples.append((w, predict(true_prof, w)))
    # mixed-class layers too
    for _ in range(20):
        w = LayerWork({c: float(rng.uniform(1e9, 1e12)) for c in OP_CLASSES},
                      {c: float(rng.uniform(1e6, 1e10)) for c in OP_CLASSES}, launches=3)
        samples.append((w, predict(true_prof, w)))
    fitted = calibrate(base, samples)
    for c in OP_CLASSES:
        for part in ("flops", "bytes"):
            got = fitted.efficiencies[c][part]
            assert got == pytest.approx(truth[c][part], rel=1e-3), (c, part)
    assert "calibrated" in fitted.sources["efficiencies"]


def test_calibration_keeps_efficiencies_at_most_one():
    base = spec("cpu")
    w = LayerWork({"matmul": 1e12}, {"matmul": 1e6})
    # measured faster than the peak allows: the fit must not go past peak
    fitted = calibrate(base, [(w, 0.5 * predict(base.replace(efficiencies={
        c: {"flops": 1.0, "bytes": 1.0} for c in OP_CLASSES}), w))])
    assert fitted.efficiencies["matmul"]["flops"] == 1.0


def test_predictions_grow_with_flops_and_bytes_and_never_beat_peak():
    for kind in spec_kinds():
        p = spec(kind)
        t_small = predict(p, LayerWork({"matmul": 1e9}, {"matmul": 1e6}))
        t_flops = predict(p, LayerWork({"matmul": 1e12}, {"matmul": 1e6}))
        t_bytes = predict(p, LayerWork({"matmul": 1e9}, {"matmul": 1e11}))
        assert t_flops > t_small and t_bytes > t_small
        for dt in ("f32", "bf16"):
            w = LayerWork({"elementwise": 1e12, "matmul": 1e13}, {"reduction": 1e10}, dtype=dt)
            floor = (1e12 / p.peak(dt) + 1e13 / p.peak(dt, "matmul")
                     + 1e10 / p.memory_bandwidth_bytes_per_s)
            assert predict(p, w) >= floor * (1 - 1e-12)


def test_spec_kind_borrows_nearest_measured_sibling():
    measured = spec("h100").replace(
        name="gpu:0", origin="measured",
        efficiencies={c: {"flops": 0.5, "bytes": 0.5} for c in OP_CLASSES},
        launch_overhead_s=2e-5,
    )
    ps = ProfileSet({"gpu:0": measured, "h200": spec("h200"), "tpu-v4": spec("tpu-v4")})
    h200 = ps.device("h200")
    assert h200.origin == "transferred"
    assert h200.efficiencies["matmul"]["flops"] == 0.5
    assert h200.memory_bandwidth_bytes_per_s == spec("h200").memory_bandwidth_bytes_per_s
    assert ps.device("tpu-v4").origin == "spec"  # no measured TPU sibling
    with pytest.raises(ProfileError, match="same class"):
        transfer_calibration(measured, spec("tpu-v4"))


def test_fit_link_recovers_latency_and_bandwidth():
    sizes = [4096 * 4**i for i in range(9)]
    lat, bw = fit_link([(b, 3e-5 + b / 12e9) for b in sizes])
    assert lat == pytest.approx(3e-5, rel=1e-6) and bw == pytest.approx(12e9, rel=1e-6)
    lk = LinkProfile("a", "b", "device_put", lat, bw, "t")
    assert lk.time(1e9) == pytest.approx(3e-5 + 1e9 / 12e9)


def test_a_links_samples_become_a_curve_that_never_falls():
    # Copies at 3.5 GB/s to 28 MiB, 1.2 GB/s from 32 MiB (an H100 host's CPU
    # device to its GPU), one sample noisily cheaper than the one before,
    # and the 4 KB copy at the fitted latency.
    mib, lat = float(1 << 20), 2e-4
    samples = ((4096.0, lat), (16 * mib, lat + 16 * mib / 3.5e9),
               (28 * mib, lat + 28 * mib / 3.5e9), (32 * mib, lat + 32 * mib / 1.2e9),
               (33 * mib, lat + 30 * mib / 1.2e9), (64 * mib, lat + 64 * mib / 1.2e9))
    lk = LinkProfile("cpu:0", "gpu:0", "device_put", lat, 2e9, "t", samples[::-1])
    curve = lk.copy_curve()
    assert [b for b, _ in curve] == [b for b, _ in samples]
    assert curve[0][1] == 0.0 and curve[1][1] == pytest.approx(16 * mib / 3.5e9)
    # the noisy pair averaged, not the higher one carried onward
    assert curve[4][1] == curve[3][1] == pytest.approx(31 * mib / 1.2e9)
    assert curve[5][1] == pytest.approx(64 * mib / 1.2e9)
    assert all(t1 <= t2 for (_, t1), (_, t2) in zip(curve, curve[1:]))
    # Priced over the path's latency, a copy takes what its sample took.
    link = Link("cpu:0", "gpu:0", 2e9, lat, curve)
    assert link.seconds(28 * mib) == pytest.approx(samples[2][1])
    # Samples at one size count once (their median); non-finite ones not at all.
    again = LinkProfile("a", "b", "device_put", lat, 2e9, "t",
                        samples + ((16 * mib, 1.0), (16 * mib, 0.0), (8 * mib, math.inf)))
    assert again.copy_curve() == curve
    # A small copy below the fitted latency (noise) prices nothing beyond it.
    noisy = LinkProfile("a", "b", "device_put", 3e-4, 2e9, "t", samples)
    assert noisy.copy_curve()[0] == (4096.0, 0.0)
    # Too few sizes, or none slower than the latency: the fitted line stands.
    two = LinkProfile("a", "b", "device_put", 1e-5, 1e9, "t", samples[:2] * 2)
    assert two.copy_curve() == ()
    flat = tuple((b, 1e-4) for b in (4096.0, 1e5, 1e6))
    assert LinkProfile("a", "b", "device_put", 1e-4, 1e9, "t", flat).copy_curve() == ()


@pytest.mark.parametrize("samples", [[[4096, "1e-4"]], [[0, 1e-4]], [[4096, -1]], [[4096]],
                                     "4096", [[4096, float("nan")]]])
def test_a_malformed_link_sample_is_named(samples):
    data = LinkProfile("cpu:0", "gpu:0", "device_put", 1e-4, 2e9, "t").to_json()
    with pytest.raises(ProfileError, match="samples"):
        LinkProfile.from_json(data | {"samples": samples})


def test_measure_stops_early_on_a_slow_function_with_a_budget():
    # A layer of a second (GPT-2's on a host CPU at batch 256) is timed three
    # times, not k, once the budget is spent; without a budget, k times.
    import time as _time

    import jax

    from hetpar.cost_models import measure

    def slow(x):
        return jax.pure_callback(lambda v: (_time.sleep(0.04), v)[1], x, x)

    x = jnp.ones(3)
    assert len(measure(slow, (x,), "cpu:0", k=6, warmup=1, budget_s=0.05).samples) == 3
    assert len(measure(slow, (x,), "cpu:0", k=6, warmup=1).samples) == 6


def test_cache_hit_skips_measurement(tmp_path, monkeypatch):
    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_measure(fn, args, device, *, k, warmup):
        calls.append(1)
        return Timing.of([1e-3, 2e-3, 3e-3])

    args = (jnp.ones((8, 8)),)
    first = measure_cached("layer-a", jnp.sin, args, "cpu:0", measure_fn=fake_measure)
    again = measure_cached("layer-a", jnp.sin, args, "cpu:0", measure_fn=fake_measure)
    assert len(calls) == 1 and not first.cached and again.cached
    assert again.median_s == first.median_s == 2e-3
    # a different shape is a different entry
    measure_cached("layer-a", jnp.sin, (jnp.ones((8, 9)),), "cpu:0", measure_fn=fake_measure)
    assert len(calls) == 2


def test_cache_entry_of_fewer_runs_than_asked_is_measured_again(tmp_path, monkeypatch):
    # A `hetpar costs --k 3` entry, or one of 10 runs from before LAYER_RUNS was
    # 40, is not the 40-run lower quartile asked for now; one that ran out of
    # its time budget is.
    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_measure(fn, args, device, *, k, warmup, budget_s=None):
        calls.append(k)
        return Timing.of([1e-3] * min(k, 5))

    args = (jnp.ones((4, 4)),)
    measure_cached("layer-k", jnp.sin, args, "cpu:0", k=3, measure_fn=fake_measure)
    measure_cached("layer-k", jnp.sin, args, "cpu:0", k=3, measure_fn=fake_measure)
    assert calls == [3]
    measure_cached("layer-k", jnp.sin, args, "cpu:0", k=10, measure_fn=fake_measure)
    assert calls == [3, 10]
    again = measure_cached("layer-k", jnp.sin, args, "cpu:0", k=10, measure_fn=fake_measure)
    assert again.cached and calls == [3, 10]  # 5 runs of the 10 asked, recorded as asked
    short = measure_cached("layer-k", jnp.sin, args, "cpu:0", k=40, budget_s=4e-3,
                           measure_fn=fake_measure)
    assert short.cached and calls == [3, 10]  # its runs reached the budget


def test_typical_time_is_the_lower_quartile_of_the_runs():
    # Interruptions only add time: two slow runs of eight move the median, not the typical time.
    t = Timing.of([1e-3, 1e-3, 1.1e-3, 1.2e-3, 1.2e-3, 1.3e-3, 9e-3, 9e-3])
    assert t.typical_s == pytest.approx(1.075e-3)
    assert t.typical_s < t.median_s == pytest.approx(1.2e-3)
    assert Timing.of([2e-3]).typical_s == 2e-3
    assert Timing.from_json(t.to_json()).typical_s == t.typical_s  # from the cached samples


def test_far_more_work_measures_slower():
    # ~30000x the FLOPs: a loaded CI machine cannot reorder these (4x once did).
    small = measure(jnp.matmul, (jnp.ones((8, 64)), jnp.ones((64, 64))), "cpu:0", k=15)
    big = measure(jnp.matmul, (jnp.ones((1024, 1024)), jnp.ones((1024, 1024))), "cpu:0", k=15)
    assert big.median_s > small.median_s
    assert len(big.samples) == 15 and big.iqr_s >= 0
    assert min(big.samples) <= big.median_s <= max(big.samples)


def test_measure_on_a_second_device():
    t = measure(lambda x: x + 1, (np.ones(4, np.float32),), "cpu:1", k=2, warmup=1)
    assert len(t.samples) == 2 and not t.cached


def test_sweep_batch():
    def make(batch):
        return jnp.tanh, (jnp.ones((batch, 64)),)

    out = sweep_batch(make, [8, 32], "cpu:0", k=3, warmup=1)
    assert [b for b, _ in out] == [8, 32]
    assert all(t.median_s > 0 for _, t in out)


def _absent_device() -> str:
    from hetpar.cost_models import present_devices

    present = set(present_devices())
    return next(n for n in ("gpu:0", "tpu:0", "gpu:99") if n not in present)


def test_absent_device_is_a_clear_error():
    absent = _absent_device()  # gpu:0 on a CPU-only machine
    with pytest.raises(ProfileError, match=f"'{absent}' is not present"):
        measure(jnp.sin, (jnp.ones(3),), absent)
    from hetpar.cost_models import profile_devices

    with pytest.raises(ProfileError, match=absent):
        profile_devices([absent], quick=True)


def _run_cli(*argv, devices=2):
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, "-m", "hetpar", *argv],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )


@pytest.mark.slow  # 3-7 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_cli_profile_quick_end_to_end(tmp_path):
    out = tmp_path / "x.json"
    r = _run_cli("profile", "--quick", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "cpu:0 -> cpu:1" in r.stderr  # progress while it runs
    ps = load_profiles(out)
    assert {"cpu:0", "cpu:1"} <= set(ps.devices)
    assert ps.devices["cpu:0"].origin == "measured"
    # the cost per array a call passes is measured (a tiny op over 16 arrays
    # against one) and priced, not left at 0 until a fit on layers
    cpu = ps.devices["cpu:0"]
    assert cpu.buffer_overhead_s == cpu.benchmarks["dispatch_per_buffer_s"] > 0
    assert "16 arrays" in cpu.sources["buffer_overhead_s"]
    assert {(lk.src, lk.dst) for lk in ps.links} == {("cpu:0", "cpu:1"), ("cpu:1", "cpu:0")}
    assert ps.fastest_link("cpu:0", "cpu:1", 1 << 20).bandwidth_bytes_per_s > 0
    # its samples price the table's copies as a curve
    assert all(len(lk.samples) == 4 and len(lk.copy_curve()) == 4 for lk in ps.links)
    # a measured cpu lends its calibration to the cpu spec sheet
    assert ps.device("cpu").origin == "transferred"
    # the two devices' collectives, timed together, kept for plans made from
    # the file (no accelerator here: no place links)
    assert "timing collectives over cpu:0+cpu:1" in r.stderr
    ring = ps.meta["collectives"]["cpu:0+cpu:1"]
    assert ring["bandwidth_bytes_per_s"] > 0 and ring["latency_s"] > 0
    assert "place_links" not in ps.meta
    # the command measured with huge pages where glibc takes them (it re-executed
    # itself with the tunable), and the file says so
    from hetpar._host_memory import has_huge_pages, wants_huge_pages

    huge = has_huge_pages() or wants_huge_pages(os.environ)
    assert json.loads(out.read_text())["meta"]["huge_pages"] is huge


def load_profiles_text(profile):
    """The benchmarks of `profile` after a round trip through the profile file format."""
    from hetpar.cost_models import ProfileSet

    data = json.loads(json.dumps(ProfileSet(devices={profile.name: profile}).to_json()))
    return ProfileSet.from_json(data).devices[profile.name].benchmarks


def test_fit_on_layers_predicts_the_measured_layers_better(tmp_path, monkeypatch):
    # The microbenchmarks' (here: the spec sheet's) efficiencies against those
    # fitted on the layers: the fit predicts them better, and says what it was fitted on.
    import statistics

    from hetpar import zoo
    from hetpar.cost_models import fit_on_layers, layer_samples

    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path))
    _, graph = zoo.trace_model("mlp", small=True, batch=32)
    before = spec("cpu").replace(name="cpu:0", origin="measured")
    dev = jax.devices("cpu")[0]
    after = fit_on_layers(before, dev, [("mlp", graph)], k=3)
    assert "fitted on" in after.sources["efficiencies"] and "mlp" in after.sources["efficiencies"]
    samples = layer_samples([("mlp", graph)], dev, k=3)  # cached: the same timings
    # The file keeps what the fit saw, in order, so it can be audited or refitted offline.
    kept = after.benchmarks["fit_layers"]
    assert [(r["model"], r["layer"], r["measured_s"]) for r in kept] == [
        (n, layer, t) for n, layer, _, t in samples]
    assert all(set(r) == {"model", "layer", "key", "measured_s", "fused_bytes", "timing"}
               for r in kept)
    assert {r["timing"] for r in kept} == {"interleaved"}  # a CPU's
    assert len({r["key"] for r in kept}) == len(kept)  # each layer's fingerprint
    assert all(r["fused_bytes"] > 0 for r in kept)  # the layer model prices them on CPUs too
    assert load_profiles_text(after)["fit_layers"] == kept

    def median_error(profile):
        return statistics.median(abs(predict(profile, w) / t - 1) for *_, w, t in samples)

    assert median_error(after) < median_error(before)


def test_fit_on_h100_layers_predicts_with_and_without_fused_bytes():
    # The H100's layers as measured (experiments/results/cross_card): fitted on the
    # default --fit models, the other models' layers are predicted from after-fusion
    # bytes and, as a table for an absent GPU has them, from unfused counts. Fitted
    # on fused bytes alone, the unfused predictions were 15x the measured times.
    import statistics

    from hetpar.cost_models import LayerWork, fit_samples

    path = REPO / "experiments/results/cross_card/accuracy_gpu_h100.json"
    records = [r for r in json.loads(path.read_text())["records"]
               if r["device"].startswith("gpu")]

    def sample(r, fused):
        work = dict(r["work"], launches=1)
        if not fused:
            work["fused_bytes"] = None
        return LayerWork.from_json(work), r["measured_s"]

    fit_models = {"alexnet", "conv6", "lm_embed", "mobilenet_v1", "transformer"}
    train = [sample(r, True) for r in records if r["model"] in fit_models]
    fitted = fit_samples(spec("h100"), train)
    assert "fitted on" in fitted.sources["efficiencies"]

    def median_error(fused):
        return statistics.median(abs(predict(fitted, w) / t - 1) for w, t in (
            sample(r, fused) for r in records if r["model"] not in fit_models))

    assert median_error(True) < 0.3 and median_error(False) < 0.4


@pytest.mark.slow  # a profile run and the fit's layer timings: ~20 s on 2 cores
def test_cli_profile_fit(tmp_path, monkeypatch):
    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "fitted.json"
    base = ["profile", "--quick", "--no-transfers", "--devices", "cpu:0"]
    r = _run_cli(*base, "--fit", "mlp,conv6", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "mlp/" in r.stderr  # a line per layer measured
    fitted = load_profiles(out).devices["cpu:0"]
    assert "fitted on" in fitted.sources["efficiencies"]
    # The per-equation model was fitted too and judged, each model left out;
    # the verdict is in the file and on the screen either way.
    assert "left out" in fitted.sources["layer_model"]
    assert "cpu:0: per-equation layer model" in r.stdout
    assert (fitted.layer_model is None) == fitted.sources["layer_model"].startswith("not used")


def test_cli_profile_fit_names_zoo_models():
    bad = _run_cli("profile", "--quick", "--fit", "nosuchmodel", "--out", "/dev/null")
    assert bad.returncode == 2 and "--fit: unknown zoo models" in bad.stderr


def test_cli_profile_absent_device():
    r = _run_cli("profile", "--quick", "--devices", "gpu:0", "--out", "/dev/null", devices=1)
    assert r.returncode == 2
    assert "gpu:0" in r.stderr and "not present" in r.stderr


def test_calibration_recovers_per_call_and_per_buffer_costs():
    base = spec("h100")
    true = base.replace(launch_overhead_s=60e-6, buffer_overhead_s=4e-6)
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(40):
        w = LayerWork({"matmul": float(rng.uniform(1e6, 1e11))},
                      {"elementwise": float(rng.uniform(1e5, 1e9))},
                      buffers=int(rng.integers(2, 60)))
        samples.append((w, predict(true, w)))
    fitted = calibrate(base, samples, fit_overhead=True)
    assert fitted.launch_overhead_s == pytest.approx(60e-6, rel=0.05)
    assert fitted.buffer_overhead_s == pytest.approx(4e-6, rel=0.05)
    for w, t in samples:
        assert predict(fitted, w) == pytest.approx(t, rel=0.05)


def test_io_bytes_bound_the_prediction_and_buffers_round_trip(tmp_path):
    p = spec("h100").replace(buffer_overhead_s=3e-6, sources={
        **spec("h100").sources, "buffer_overhead_s": "test"})
    w = LayerWork({}, {}, launches=0, io_bytes=1e9, buffers=0)
    assert predict(p, w) >= 1e9 / p.memory_bandwidth_bytes_per_s
    assert predict(p, LayerWork({}, {}, buffers=10)) == pytest.approx(
        p.launch_overhead_s + 10 * 3e-6)
    assert LayerWork.from_json(LayerWork({}, {}, buffers=7, io_bytes=5.0).to_json()).buffers == 7
    again = DeviceProfile.from_json(json.loads(json.dumps(p.to_json())))
    assert again.buffer_overhead_s == 3e-6
    assert transfer_calibration(p, spec("a100")).buffer_overhead_s == 3e-6


def test_fused_bytes_are_read_on_cpu_and_undercut_the_unfused_count():
    from hetpar.cost_models import layer_fused_bytes, layer_work
    from hetpar.passes import trace

    def chain(x):
        for _ in range(6):
            x = jnp.tanh(x) * 1.5 + 0.25
        return x

    x = jnp.ones((256, 256), jnp.float32)
    graph = trace(lambda x: jnp.sum(chain(x)), x)
    for name in graph.layers:
        fused = layer_fused_bytes(graph, name, "cpu")
        assert fused is not None and fused > 0
        unfused = sum(layer_work(graph[name]).bytes_by_class.values())
        assert fused <= unfused


_HLO = """HloModule jit_f, entry_computation_layout={(f32[8,8]{1,0})->(f32[8,8]{1,0}, f32[])}

%fused_computation (param_0: f32[8,8]) -> f32[8,8] {
  %param_0 = f32[8,8]{1,0} parameter(0)
  ROOT %tanh.1 = f32[8,8]{1,0} tanh(f32[8,8]{1,0} %param_0)
}

ENTRY %main.5 (Arg_0.1: f32[8,8]) -> (f32[8,8], f32[]) {
  %Arg_0.1 = f32[8,8]{1,0} parameter(0)
  %constant.2 = f32[] constant(1)
  %fusion = f32[8,8]{1,0} fusion(f32[8,8]{1,0} %Arg_0.1), kind=kLoop, calls=%fused_computation
  %custom-call.3 = (f32[8,8], s8[0]) custom-call(f32[8,8] %fusion), custom_call_target="gemm"
  %get-tuple-element.4 = f32[8,8] get-tuple-element((f32[8,8], s8[0]) %custom-call.3), index=0
  %bitcast.5 = f32[64]{0} bitcast(f32[8,8]{1,0} %get-tuple-element.4)
  %reduce.6 = f32[] reduce(f32[64]{0} %bitcast.5, f32[] %constant.2), dimensions={0}, to_apply=%add
  ROOT %tuple.7 = (f32[8,8]{1,0}, f32[]) tuple(f32[8,8]{1,0} %get-tuple-element.4, f32[] %reduce.6)
}
"""


def test_count_kernels_counts_entry_instructions_that_launch():
    from hetpar.cost_models import count_kernels

    # fusion, custom call, reduce; not parameters, constants, tuples, bitcasts,
    # nor the instructions of the fused computation.
    assert count_kernels(_HLO) == 3
    assert count_kernels("HloModule nothing") is None


def test_layer_kernels_on_cpu_count_the_compiled_layer():
    from hetpar.cost_models import count_kernels, layer_kernels
    from hetpar.passes import hlo_text, trace

    x = jnp.ones((64, 64), jnp.float32)
    graph = trace(lambda x: jnp.sum(jnp.tanh(x @ x) * 2.0), x)
    for name in graph.layers:
        n = layer_kernels(graph, name, "cpu")
        assert n is not None and n >= 1
        assert n == count_kernels(hlo_text(graph, name, optimized=True, backend="cpu"))


def test_per_kernel_launch_cost_is_fitted_from_kernel_counts():
    # experiments/cost_accuracy.py's `kernels` launch model: launches = the
    # layer's kernel count, and calibrate fits the per-kernel cost.
    from hetpar.cost_models import LayerWork, calibrate, predict, spec

    prof = spec("cpu")
    bw = prof.memory_bandwidth_bytes_per_s
    samples = []
    for k, nbytes in [(3, 1e6), (10, 1e6), (30, 4e6), (60, 2e6), (120, 8e6), (20, 3e7)]:
        work = LayerWork({"elementwise": 1e3}, {"elementwise": nbytes}, launches=k)
        samples.append((work, k * 4e-6 + nbytes / (0.5 * bw)))
    fitted = calibrate(prof, samples, fit_overhead=True)
    assert fitted.launch_overhead_s == pytest.approx(4e-6, rel=0.05)
    for work, t in samples:
        assert predict(fitted, work) == pytest.approx(t, rel=0.05)


def test_predictor_uses_fused_bytes_when_known():

    from hetpar.cost_models import DeviceProfile, LayerWork, calibrate, predict, spec

    prof = spec("h100")
    work = LayerWork({"elementwise": 1e6}, {"elementwise": 8e9}, io_bytes=1e8)
    fused = dataclasses.replace(work, fused_bytes=1e9)
    assert predict(prof, fused) < predict(prof, work)
    # The fused traffic at the calibrated efficiency, never beating the bandwidth.
    half = prof.replace(fused_bytes_efficiency=0.5)
    bw = prof.memory_bandwidth_bytes_per_s
    assert predict(half, fused) >= 1e9 / (0.5 * bw)
    assert predict(half, fused) > predict(prof.replace(fused_bytes_efficiency=1.0), fused)
    # Never below io_bytes / bandwidth, even with a tiny fused count.
    tiny = dataclasses.replace(work, fused_bytes=1.0)
    assert predict(prof, tiny) >= 1e8 / bw
    # The calibration fits the fused-bytes efficiency and keeps it <= 1.
    samples = [(dataclasses.replace(work, fused_bytes=b), b / (0.4 * bw) + prof.launch_overhead_s)
               for b in (1e8, 3e8, 1e9, 3e9)]
    cal = calibrate(prof, samples)
    assert 0.3 < cal.fused_bytes_efficiency <= 1.0
    back = DeviceProfile.from_json(cal.to_json())
    assert back.fused_bytes_efficiency == cal.fused_bytes_efficiency


def test_loading_a_quick_profile_warns(tmp_path, caplog):
    import logging as pylogging

    path = tmp_path / "quick.json"
    ps = ProfileSet({"cpu:0": spec("cpu").replace(name="cpu:0")}, (), {"mode": "quick"})
    save_profiles(path, ps)
    with caplog.at_level(pylogging.WARNING):
        load_profiles(path)
    assert "--quick" in caplog.text and "links on transfers up to 16 MB" in caplog.text


def test_roofline_classes_map_every_jaxpr_op_class():
    from hetpar import passes
    from hetpar.cost_models import ROOFLINE_CLASS

    # One vocabulary: the jaxpr's op classes; the roofline's are their images.
    assert set(ROOFLINE_CLASS) == set(passes.OP_CLASSES)
    assert tuple(dict.fromkeys(ROOFLINE_CLASS.values())) == OP_CLASSES
    assert {passes.op_class(p) for p in ("dot_general", "exp", "reduce_sum", "gather",
                                         "scan")} <= set(ROOFLINE_CLASS)


def _conv_and_dot_samples(prof, dot_eff, conv_eff):
    """Compute-bound layers mixing dots and convolutions, timed at two efficiencies."""
    peak = prof.peak("f32", "matmul")
    samples = []
    for dot, conv in [(4e12, 0.0), (1e13, 0.0), (2e12, 2e12), (1e12, 6e12), (0.0, 3e12),
                      (6e12, 1e12), (0.0, 8e12), (3e12, 5e11)]:
        work = LayerWork({"matmul": dot + conv}, {"matmul": 1e6}, launches=1,
                         conv_flops=conv)
        t = dot / (dot_eff * peak) + conv / (conv_eff * peak) + prof.launch_overhead_s
        samples.append((work, t))
    return samples


def test_convolutions_get_an_efficiency_of_their_own_when_asked():
    # cuDNN's convolutions and cuBLAS's GEMMs reach different fractions of the
    # peak: one matmul efficiency for both misses one of them.
    prof = spec("h100")
    samples = _conv_and_dot_samples(prof, dot_eff=0.5, conv_eff=0.15)
    shared = calibrate(prof, samples)
    assert shared.conv_efficiency is None
    worst_shared = max(abs(predict(shared, w) - t) / t for w, t in samples)
    assert worst_shared > 0.2
    own = calibrate(prof, samples, fit_conv=True)
    assert own.efficiencies["matmul"]["flops"] == pytest.approx(0.5, rel=1e-3)
    assert own.conv_efficiency == pytest.approx(0.15, rel=1e-3)
    assert "convolutions" in own.sources["conv_efficiency"]
    for w, t in samples:
        assert predict(own, w) == pytest.approx(t, rel=1e-3)
    # Without convolutions the data say nothing about their efficiency.
    dots = [(w, t) for w, t in samples if w.conv_flops == 0]
    assert calibrate(prof, dots, fit_conv=True).conv_efficiency is None


def test_conv_efficiency_round_trips_transfers_and_applies_only_to_conv_flops():
    prof = spec("h100")
    own = calibrate(prof, _conv_and_dot_samples(prof, 0.5, 0.15), fit_conv=True)
    back = DeviceProfile.from_json(json.loads(json.dumps(own.to_json())))
    assert back.conv_efficiency == own.conv_efficiency
    assert transfer_calibration(own, spec("a100")).conv_efficiency == own.conv_efficiency
    assert "conv_efficiency" not in prof.to_json()
    bad = dict(own.to_json(), conv_efficiency=1.5)
    with pytest.raises(ProfileError, match="conv_efficiency"):
        DeviceProfile.from_json(bad)
    # A dot-only layer ignores it; a conv layer is charged at it.
    dot = LayerWork({"matmul": 1e13}, {"matmul": 1e6})
    conv = dataclasses.replace(dot, conv_flops=1e13)
    slow = prof.replace(conv_efficiency=0.01)
    assert predict(slow, dot) == predict(prof, dot)
    assert predict(slow, conv) > 10 * predict(prof, conv)
    # Unset, a convolution costs what a dot of the same FLOPs costs (as before).
    assert predict(prof, conv) == predict(prof, dot)
    # A profile's conv efficiency holds while calibrating without fit_conv.
    fixed = calibrate(slow, _conv_and_dot_samples(prof, 0.5, 0.01))
    assert fixed.conv_efficiency == 0.01
    assert fixed.efficiencies["matmul"]["flops"] == pytest.approx(0.5, rel=1e-3)


def test_layer_work_counts_convolution_flops_within_the_matmul_class():
    from hetpar.cost_models import graph_layer_work
    from hetpar.passes import trace

    x = jnp.ones((2, 8, 16, 16), jnp.float32)
    k = jnp.ones((4, 8, 3, 3), jnp.float32)
    m = jnp.ones((16, 16), jnp.float32)

    def f(x, k, m):
        y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME")
        return jnp.sum(y @ m)

    graph = trace(f, x, k, m)
    works = [graph_layer_work(graph, name) for name in graph.layers]
    conv = sum(w.conv_flops for w in works)
    matmul = sum(w.flops("matmul") for w in works)
    assert 0 < conv < matmul  # the dot's FLOPs are matmul, not convolution
    with pytest.raises(ProfileError, match="conv_flops"):
        LayerWork({"matmul": 1.0}, {}, conv_flops=2.0)
    old = {k: v for k, v in works[0].to_json().items() if k != "conv_flops"}
    assert LayerWork.from_json(old).conv_flops == 0.0  # records saved before the field


# Timing several layers together (interleaved) -------------------------------

def _mlp_graph():
    from hetpar.zoo import trace_model

    return trace_model("mlp", small=True, batch=8)[1]


def test_a_cpus_layers_are_timed_together_and_cached_each(tmp_path, monkeypatch):
    # On a host CPU a layer timed back to back ran up to 2.9x faster than after
    # the other layers, as a step runs it (experiments/results/cpu_timing).
    from hetpar.cost_models import _measure, measure_layer, measure_layers

    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path))
    graph = _mlp_graph()
    layers = list(graph.layers)
    groups = []
    real = _measure._time_group
    monkeypatch.setattr(_measure, "_time_group",
                        lambda items, *a, **kw: groups.append(len(items)) or real(items, *a, **kw))
    timings = measure_layers(graph, layers, "cpu:0", k=4)
    assert groups == [len(layers)]  # one round-robin over all of them
    assert [len(t.samples) for t in timings] == [4] * len(layers)
    assert not any(t.cached for t in timings)
    entries = [json.loads(p.read_text()) for p in (tmp_path / "measure").glob("*.json")]
    assert len(entries) == len(layers)
    assert {e["protocol"] for e in entries} == {"interleaved"}
    # measure_layer (the cost table's rows) reads what was timed together
    again = measure_layer(graph, layers[1], "cpu:0", k=4)
    assert again.cached and again.samples == timings[1].samples
    assert groups == [len(layers)]


def test_interleaved_groups_keep_to_the_byte_bound_and_the_order(tmp_path, monkeypatch):
    from hetpar.cost_models import _measure

    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_measure, "INTERLEAVE_BYTES", 600)  # two (8, 8) f32 arguments
    groups = []

    def fake(items, dev, *, k, warmup, budget_s=None):
        groups.append([it.key for it in items])
        return [[float(it.key[1:])] * k for it in items]

    monkeypatch.setattr(_measure, "_time_group", fake)
    shape = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    items = [_measure.Timed(f"f{i}", jnp.sin, [shape], lambda: [jnp.ones((8, 8))])
             for i in range(5)]
    out = _measure.measure_interleaved(items, "cpu:0", k=3)
    assert groups == [["f0", "f1"], ["f2", "f3"], ["f4"]]
    assert [t.median_s for t in out] == [0.0, 1.0, 2.0, 3.0, 4.0]
    again = _measure.measure_interleaved(items[::-1], "cpu:0", k=3)
    assert len(groups) == 3 and [t.median_s for t in again] == [4.0, 3.0, 2.0, 1.0, 0.0]


def test_interleaved_rounds_leave_a_slow_function_at_its_budget():
    import time as _time

    from hetpar.cost_models import _measure

    def slow(x):
        return jax.pure_callback(lambda v: (_time.sleep(0.03), v)[1], x, x)

    x = jax.ShapeDtypeStruct((3,), jnp.float32)
    key = jax.random.key(0)  # a typed PRNG key argument (cnn_preprocess's)
    items = [_measure.Timed("slow", slow, [x], lambda: [jnp.ones(3)]),
             _measure.Timed("fast", lambda k: jax.random.normal(k, (4,)),
                            [jax.ShapeDtypeStruct((), key.dtype)], lambda: [key])]
    slow_runs, fast_runs = _measure._time_group(items, jax.devices("cpu")[0], k=6, warmup=1,
                                                budget_s=0.05)
    assert len(slow_runs) == 3 and len(fast_runs) == 6
    assert _measure._nbytes(items[1].shapes) > 0


def test_accelerators_keep_back_to_back_timing(tmp_path, monkeypatch):
    # Only platforms measured interleaved are (`INTERLEAVED_PLATFORMS`); the
    # others, whose per-layer goals were met back to back, keep `measure`.
    from hetpar.cost_models import _layer_timing, _measure, measure_layers

    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_layer_timing, "INTERLEAVED_PLATFORMS", ())
    graph = _mlp_graph()
    calls = []
    real = _measure.measure
    monkeypatch.setattr(_measure, "measure",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(_measure, "_time_group", lambda *a, **kw: pytest.fail("interleaved"))
    timings = measure_layers(graph, list(graph.layers), "cpu:0", k=3)
    assert len(calls) == len(graph.layers) and len(timings) == len(graph.layers)


def test_a_cpus_updates_are_timed_together_and_measure_update_reads_them(tmp_path, monkeypatch):
    # The offload planner's host updates: small stages a step runs among others.
    from hetpar.cost_models import _measure, measure_layers, measure_update
    from hetpar.zoo import trace_model

    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path))
    graph = trace_model("lm_embed", small=True, batch=8)[1]
    groups = []
    real = _measure._time_group
    monkeypatch.setattr(_measure, "_time_group",
                        lambda items, *a, **kw: groups.append(len(items)) or real(items, *a, **kw))
    timings = measure_layers(graph, list(graph.layers), "cpu:0", update=True, k=3)
    assert graph.layers[0] == "vectorize" and timings[0] is None  # no parameters, no update
    assert all(t is not None and len(t.samples) == 3 for t in timings[1:])
    assert groups == [len(graph.layers) - 1]
    again = measure_update(graph, graph.layers[1], "cpu:0", k=3)
    assert again.cached and again.samples == timings[1].samples
    # keyed apart from the layer's own stage
    assert not measure_layers(graph, [graph.layers[1]], "cpu:0", k=3)[0].cached


def test_a_layer_timed_alone_is_timed_again_among_the_others(tmp_path, monkeypatch):
    # measure_layer on its own has nothing to alternate with: back to back.
    from hetpar.cost_models import _measure, measure_layer, measure_layers

    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path))
    graph = _mlp_graph()
    layers = list(graph.layers)
    alone = measure_layer(graph, layers[0], "cpu:0", k=3)
    groups = []
    real = _measure._time_group
    monkeypatch.setattr(_measure, "_time_group",
                        lambda items, *a, **kw: groups.append(len(items)) or real(items, *a, **kw))
    together = measure_layers(graph, layers, "cpu:0", k=3)
    assert groups == [len(layers)] and not together[0].cached
    assert together[0].samples != alone.samples
    assert measure_layer(graph, layers[0], "cpu:0", k=3).cached  # the one timed among others


def test_identical_functions_are_timed_once_and_share_it(tmp_path, monkeypatch):
    from hetpar.cost_models import _measure

    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path))
    shape = jax.ShapeDtypeStruct((8, 8), jnp.float32)

    def item(key):
        return _measure.Timed(key, jnp.sin, [shape], lambda: [jnp.ones((8, 8))])

    timed = []
    real = _measure._time_group
    monkeypatch.setattr(_measure, "_time_group",
                        lambda items, *a, **kw: timed.append([i.key for i in items])
                        or real(items, *a, **kw))
    a, b, a2 = _measure.measure_interleaved([item("a"), item("b"), item("a")], "cpu:0", k=3)
    assert timed == [["a", "b"]] and a is a2


def test_a_lone_function_left_in_the_rounds_alternates_with_a_finished_one():
    import time as _time

    from hetpar.cost_models import _measure

    calls = {"slow": 0, "fast": 0}

    def counted(name, pause):
        def fn(x):
            def host(v):
                calls[name] += 1
                _time.sleep(pause)
                return v
            return jax.pure_callback(host, x, x)
        return fn

    x = jax.ShapeDtypeStruct((3,), jnp.float32)
    # Slow's 3 runs (0.6 s) pass the budget; fast's 8 stay far under it even
    # on a loaded machine (62 ms a call), so the counts do not hang on timing.
    items = [_measure.Timed("slow", counted("slow", 0.2), [x], lambda: [jnp.ones(3)]),
             _measure.Timed("fast", counted("fast", 0.0), [x], lambda: [jnp.ones(3)])]
    slow, fast = _measure._time_group(items, jax.devices("cpu")[0], k=8, warmup=1,
                                      budget_s=0.5)
    assert len(slow) == 3 and len(fast) == 8
    # 1 warm-up + 3 timed, then once before each of fast's 5 lone runs
    assert calls["slow"] == 1 + 3 + 5


def test_a_function_that_fails_to_time_is_named(tmp_path, monkeypatch):
    from hetpar.cost_models import _measure

    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path))

    def broken(x):
        raise RuntimeError("no kernel for this")

    shape = jax.ShapeDtypeStruct((3,), jnp.float32)
    items = [_measure.Timed("ok", jnp.sin, [shape], lambda: [jnp.ones(3)], name="fc1"),
             _measure.Timed("bad", broken, [shape], lambda: [jnp.ones(3)], name="fc2")]
    with pytest.raises(ProfileError, match="timing fc2 on .*no kernel for this"):
        _measure.measure_interleaved(items, "cpu:0", k=3)


def test_a_cache_entry_of_the_wrong_types_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path))
    args = (jnp.ones((4, 4)),)
    calls = []

    def fake_measure(fn, args, device, *, k, warmup, budget_s=None):
        calls.append(k)
        return Timing.of([1e-3] * k)

    measure_cached("layer-t", jnp.sin, args, "cpu:0", k=3, measure_fn=fake_measure)
    (entry,) = (tmp_path / "measure").glob("*.json")
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "k": "forty"}))
    again = measure_cached("layer-t", jnp.sin, args, "cpu:0", k=5, measure_fn=fake_measure)
    assert calls == [3, 5] and not again.cached
