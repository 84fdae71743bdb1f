"""The per-equation layer model (`hetpar.cost_models._equation_model`): what it
counts, its fit, the profile field, and its use in cost tables."""

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import hetpar
from hetpar import ProfileError
from hetpar.cost_models import (
    DeviceProfile,
    cost_table,
    fit_equation_model,
    fit_samples,
    graph_layer_work,
    load_profiles,
    matmul_equations,
    predict,
    predict_layer,
    spec,
    transfer_calibration,
    with_layer_model,
)
from hetpar.cost_models._equation_model import (
    TERMS,
    MatmulEquation,
    device_tiling,
    predict_equations,
    terms,
    useful_fraction,
)


class _Net(nn.Module):
    """Written as Flax users write it: a conv stem, a transposed conv, a
    depthwise conv and a dense head, each a named module."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), name="conv")(x))
        x = nn.relu(nn.ConvTranspose(8, (3, 3), strides=(2, 2), name="up")(x))
        x = nn.relu(nn.Conv(8, (3, 3), feature_group_count=8, name="depthwise")(x))
        return nn.Dense(10, name="head")(x.reshape(x.shape[0], -1))


def _graph(batch=4):
    model, tx = _Net(), optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    x = jnp.ones((batch, 8, 8, 3))
    y = jnp.zeros((batch,), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), x)
    opt = tx.init(params)

    def step(params, opt, x, y):
        def loss(p):
            logits = model.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    return hetpar.trace(step, params, opt, x, y, depth=2)


def _layer(graph, part):
    return next(n for n in graph.layers if part in n)


def test_each_convolution_kind_gets_its_class():
    g = _graph()
    classes = {part: {e.cls for e in matmul_equations(g, _layer(g, part))}
               for part in ("conv", "up", "depthwise", "head")}
    assert classes["head"] == {"dot"}  # forward, input and weight gradients
    assert classes["depthwise"] == {"dw"}
    # a conv's weight gradient has a kernel-shaped output
    assert {"conv", "wgrad"} <= classes["conv"]
    # Flax's ConvTranspose is an input-dilated convolution without a reversed kernel
    assert "tr" in classes["up"]
    up = [e for e in matmul_equations(g, _layer(g, "up")) if e.cls == "tr"]
    assert all(e.flops > 0 and e.m > 0 and e.n > 0 and e.k > 0 for e in up)


def test_useful_fraction_of_tiles_and_waves():
    assert useful_fraction(64 * 132, 64, 32, 132) == pytest.approx(1.0)
    # one 64x64 tile of 132 units: 1/132 of a wave busy
    assert useful_fraction(64, 64, 32, 132) == pytest.approx(1 / 132)
    # a ragged edge pads the tile
    assert useful_fraction(32 * 132, 64, 32, 132) == pytest.approx(0.5)


def _samples(profile, truth, graph):
    out = []
    for layer in graph.layers:
        eqs, work = matmul_equations(graph, layer), graph_layer_work(graph, layer)
        t = terms(eqs, work, peak=profile.peak("f32", "matmul"),
                  bandwidth=profile.memory_bandwidth_bytes_per_s, units=132,
                  cpu=profile.device_class == "cpu")
        out.append((eqs, work, sum(truth.get(k, 0.0) * v for k, v in t.items())))
    return out


def test_fit_recovers_times_made_by_known_coefficients():
    prof = spec("h100")
    truth = {"c0": 20e-6, "buffers": 2e-6, "flops_dot": 3.0, "flops_conv": 5.0,
             "flops_wgrad": 8.0, "flops_dw": 40.0, "flops_tr": 12.0, "bytes": 1.5}
    samples = []
    for batch in (2, 4, 8, 16):
        samples += _samples(prof, truth, _graph(batch))
    coef = fit_equation_model(prof, samples)
    assert set(coef) == set(TERMS)
    fitted = prof.replace(layer_model=coef)
    for eqs, work, t in samples:
        assert predict_layer(fitted, work, eqs) == pytest.approx(t, rel=0.02)


def test_unseen_class_borrows_its_parent():
    prof = spec("h100")
    truth = {"c0": 10e-6, "flops_dot": 2.0, "bytes": 1.0}
    g = _graph()
    dense = [s for s, layer in zip(_samples(prof, truth, g), g.layers) if "head" in layer]
    coef = fit_equation_model(prof, dense * 3)
    assert coef["flops_conv"] == coef["flops_dot"] == coef["flops_wgrad"]


def test_fit_refuses_no_samples_and_bad_times():
    with pytest.raises(ProfileError, match="no measured layers"):
        fit_equation_model(spec("h100"), [])
    g = _graph()
    layer = g.layers[0]
    bad = [(matmul_equations(g, layer), graph_layer_work(g, layer), 0.0)]
    with pytest.raises(ProfileError, match="positive"):
        fit_equation_model(spec("h100"), bad)


def test_profile_round_trips_the_layer_model_and_names_unknown_terms():
    coef = dict.fromkeys(TERMS, 1e-3)
    prof = spec("h100").replace(layer_model=coef)
    again = DeviceProfile.from_json(json.loads(json.dumps(prof.to_json())))
    assert again.layer_model == coef
    assert "layer_model" not in spec("h100").to_json()
    data = prof.to_json()
    data["layer_model"] = {**coef, "flops_gemm": 1.0}
    with pytest.raises(ProfileError, match="unknown.*flops_gemm"):
        DeviceProfile.from_json(data)
    # a partial model would price the terms it lacks at nothing
    data["layer_model"] = {"c0": 1e-5}
    with pytest.raises(ProfileError, match="missing.*flops_dot"):
        DeviceProfile.from_json(data)
    data["layer_model"] = {**coef, "c0": -1.0}
    with pytest.raises(ProfileError, match="layer_model.c0"):
        DeviceProfile.from_json(data)


def test_a_sibling_spec_sheet_borrows_the_layer_model():
    coef = dict.fromkeys(TERMS, 1e-3)
    moved = transfer_calibration(spec("h100").replace(name="gpu:0", origin="measured",
                                                      layer_model=coef), spec("h200"))
    assert moved.layer_model == coef and "transferred" in moved.sources["layer_model"]
    # its own peak and bandwidth price the terms
    g = _graph()
    layer = _layer(g, "head")
    eqs, work = matmul_equations(g, layer), graph_layer_work(g, layer)
    assert predict_layer(moved, work, eqs) != predict_layer(
        spec("h100").replace(layer_model=coef), work, eqs)


def test_cost_table_predicts_with_the_layer_model_where_a_profile_has_one():
    g = _graph()
    coef = dict.fromkeys(TERMS, 0.0) | {"c0": 1e-3, "flops_dot": 10.0, "flops_conv": 10.0,
                                        "flops_wgrad": 10.0, "flops_dw": 10.0,
                                        "flops_tr": 10.0}
    profiles = load_profiles()
    profiles = profiles.replace_devices({**profiles.devices,
                                         "h100": spec("h100").replace(layer_model=coef)})
    table = cost_table(g, ["h100", "h200"], profiles=profiles)
    for layer in table.layers:
        work = graph_layer_work(g, layer.name)
        eqs = matmul_equations(g, layer.name)
        assert layer.time_s["h100:0"] == pytest.approx(predict_layer(
            profiles.device("h100"), work, eqs))
        assert layer.time_s["h100:0"] >= 1e-3  # the layer model's fixed part
        assert layer.time_s["h200:0"] == pytest.approx(predict(profiles.device("h200"), work))


def test_a_cpu_prices_after_fusion_bytes_in_its_layer_model_not_its_roofline():
    # On the hosts' CPUs the layer model predicted held-out layers at 11-18%
    # with XLA's after-fusion bytes and 35-40% without; the roofline got
    # worse with them. So the table hands a present CPU its fused bytes only
    # when its profile has a layer model, and the roofline ignores them there.
    from hetpar.cost_models import layer_fused_bytes

    g = _graph()
    layer = g.layers[0]
    work = graph_layer_work(g, layer)
    fused = dataclasses.replace(work, fused_bytes=layer_fused_bytes(g, layer, "cpu"))
    assert fused.fused_bytes and fused.fused_bytes != sum(work.bytes_by_class.values())
    assert predict(spec("cpu"), fused) == predict(spec("cpu"), work)
    assert predict(spec("h100"), fused) != predict(spec("h100"), work)

    coef = dict.fromkeys(TERMS, 0.0) | {"bytes": 50.0}  # time from the bytes term alone
    profiles = load_profiles()
    measured = spec("cpu").replace(name="cpu:0", origin="measured")
    for with_model, expected in ((True, fused), (False, work)):
        p = measured.replace(layer_model=coef if with_model else None)
        table = cost_table(g, ["cpu:0"], profiles=profiles.replace_devices({"cpu:0": p}),
                           fused_bytes=True, host_cpu_included=False)
        got = next(la for la in table.layers if la.name == layer).time_s["cpu:0"]
        assert got == pytest.approx(predict_layer(p, expected, matmul_equations(g, layer)))
    assert predict_layer(measured.replace(layer_model=coef), fused) != pytest.approx(
        predict_layer(measured.replace(layer_model=coef), work))


def test_with_layer_model_keeps_it_only_where_it_predicts_better():
    prof = spec("h100").replace(name="gpu:0", origin="measured")
    truth = {"c0": 20e-6, "flops_dot": 3.0, "flops_conv": 5.0, "flops_wgrad": 30.0,
             "flops_dw": 40.0, "flops_tr": 12.0, "bytes": 1.5}
    samples = []
    for batch in (2, 4, 8, 16, 32):
        g = _graph(batch)
        samples += [(f"b{batch}", *s) for s in _samples(prof, truth, g)]
    roof = fit_samples(prof, [(w, t) for _, _, w, t in samples])
    kept = with_layer_model(prof, roof, samples, what="synthetic layers")
    assert kept.layer_model is not None and "left out" in kept.sources["layer_model"]
    # Times set by matmul FLOPs, with the equation model shown no equations:
    # only the roofline sees what sets them.
    plain = [(m, (), w, 1e-5 + w.flops_by_class.get("matmul", 0.0) / 1e12)
             for m, _, w, _ in samples]
    roof = fit_samples(prof, [(w, t) for _, _, w, t in plain])
    dropped = with_layer_model(prof, roof, plain, what="elementwise times")
    assert dropped.layer_model is None and "not used" in dropped.sources["layer_model"]
    # one model: nothing to hold out, no choice made
    one = [("only", *s[1:]) for s in samples]
    assert with_layer_model(prof, roof, one).layer_model is None


def test_a_layer_without_matmuls_has_only_fixed_and_bytes_terms():
    work = graph_layer_work(_graph(), _graph().layers[0])
    t = terms((), work, peak=1e12, bandwidth=1e12, units=132, cpu=False)
    assert tuple(t) == TERMS
    assert all(v == 0 for k, v in t.items() if k.startswith(("flops_", "calls_")))
    assert t["c0"] == 1 and t["bytes"] > 0


def test_a_tpu_prices_matmuls_in_mxu_blocks_not_gpu_tiles():
    # A v4 chip: 8 MXUs of 128x128; a 10-column dense layer fills 10/128 of
    # each block there, 10/64 of a GPU tile. With a GPU's 132 units the
    # model had priced TPUs as H100s.
    assert device_tiling(spec("tpu-v4")) == ((8, 128, 128), 8)
    assert device_tiling(spec("tpu-v5e"))[1] == 4
    assert device_tiling(spec("h100")) == ((64, 64, 32), 132)
    # a TPU without a spec sheet (a measured v5p, say) is still a TPU
    assert device_tiling(spec("tpu-v4").replace(kind="tpu")) == ((8, 128, 128), 4)
    eq = MatmulEquation("dot", 1.0, 2 * 128 * 10 * 1024, 128, 10, 1024)
    work = graph_layer_work(_graph(), _graph().layers[0])

    def flops_term(kind):
        # through what predict_layer and fit_equation_model price with
        p = spec(kind).replace(layer_model=dict.fromkeys(TERMS, 0.0) | {"flops_dot": 1.0})
        return predict_equations(p, (eq,), work) * p.peak("f32", "matmul") / eq.flops

    assert flops_term("tpu-v4") == pytest.approx(128 / 10)  # 1 / the useful fraction
    assert flops_term("h100") == pytest.approx(132 / 2 * 64 / 10)  # 2 tiles: 130 SMs idle


@pytest.mark.slow
def test_held_out_zoo_layers_on_the_h100_within_ten_percent():
    """Issue 17's per-layer goal, on the committed H100 measurements
    (experiments/results: the zoo's layers and the layer sweep, timed there):
    fitted on the sweep and the zoo's train models, the held-out models'
    layers above 100 us are predicted within 10% median, and better than the
    calibrated roofline fitted on the same layers. Every layer is traced
    again here (~1 min)."""
    import pathlib
    import sys

    repo = pathlib.Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo / "experiments"))
    import layer_model_check as check

    from hetpar.cost_models import LayerWork

    train_models = {"alexnet", "conv6", "lm_embed", "mobilenet_v1", "resnet50", "transformer"}
    res = repo / "experiments/results"
    zoo = check._records(res / "cross_card/accuracy_v3_h100.json", "gpu:0")
    sweep = check._records(res / "layer_sweep_gpu/sweep_h100.json", "gpu:0")
    eqs = check._equations(zoo + sweep)

    def sample(r):
        return eqs[id(r)], LayerWork.from_json(r["work"]), r["measured_s"]

    train = [sample(r) for r in sweep + zoo
             if id(r) in eqs and (r["model"] == "sweep" or r["model"] in train_models)]
    test = [sample(r) for r in zoo if id(r) in eqs and r["model"] not in train_models
            and r["measured_s"] > 100e-6]
    assert len(train) > 100 and len(test) > 30
    base = spec("h100").replace(name="gpu:0", origin="measured")
    roof = fit_samples(base, [(w, t) for _, w, t in train])
    eq = roof.replace(layer_model=fit_equation_model(roof, train))
    err_eq = sorted(abs(predict_layer(eq, w, e) / t - 1) for e, w, t in test)
    err_roof = sorted(abs(predict(roof, w) / t - 1) for _, w, t in test)
    median = err_eq[len(err_eq) // 2]
    assert median <= 0.10, f"held-out median {median:.1%}"
    assert median < err_roof[len(err_roof) // 2]


def test_the_layer_sweep_is_the_one_the_model_was_scored_on():
    """hetpar's sweep (what `hetpar profile --fit default` times) has the
    layers, shapes included, of the committed sweep records the layer model
    was scored on (experiments/results/layer_model)."""
    import pathlib

    from hetpar import zoo
    from hetpar.cli._profile import FIT_MODELS, _fit_models

    repo = pathlib.Path(__file__).resolve().parents[1]
    path = repo / "experiments/results/layer_sweep_gpu/sweep_h100.json"
    records = json.loads(path.read_text())["records"]
    for cpu in (False, True):
        names = {sp.name for sp in (zoo.sweep_grid(0.25, 0.5) if cpu else zoo.sweep_grid())}
        recorded = {r["layer"] for r in records if (r["device"] == "cpu:0") == cpu}
        assert names == recorded
    graph = zoo.trace_sweep(cpu=True)
    assert len(graph.layers) == 55
    assert "sweep" in FIT_MODELS and _fit_models("default")[-1] == "sweep"
    assert _fit_models("mlp,sweep") == ["mlp", "sweep"]


def test_fit_default_is_the_training_split():
    """`--fit default` times the zoo models every offline figure was fitted on
    (experiments/cost_accuracy.py's `TRAIN_MODELS`), none held out: without
    resnet50 the hosts' CPU fits predicted held-out layers 1.6-1.9x worse."""
    import ast
    import pathlib

    from hetpar.cli._profile import FIT_MODELS

    # Read, not imported: the script defines absl flags (its --k among them),
    # which the CLI's parser would then meet again in this process.
    path = pathlib.Path(__file__).resolve().parents[1] / "experiments/cost_accuracy.py"
    train = next(ast.literal_eval(node.value) for node in ast.parse(path.read_text()).body
                 if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "TRAIN_MODELS" for t in node.targets))
    assert set(FIT_MODELS) - {"sweep"} == set(train)


@pytest.mark.slow  # 3-7 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_a_cpu_fits_only_the_sweeps_transposed_convolutions():
    """On a CPU, `--fit` takes from the sweep only the kinds the zoo's fit
    models lack (transposed convolutions), and for the layer model only: the
    whole sweep made its held-out predictions worse, a class it never timed
    borrowed the convolutions' coefficients (~200x too fast per FLOP on XLA's
    CPU), and the roofline's one convolution efficiency is not theirs."""
    from hetpar import zoo
    from hetpar.cli._profile import CPU_SWEEP_KINDS, _fitted

    graph = zoo.trace_sweep(cpu=True, kinds=CPU_SWEEP_KINDS)
    assert graph.layers and all(la.startswith("transposed") for la in graph.layers)
    assert all("tr" in {e.cls for e in matmul_equations(graph, la)} for la in graph.layers)
    with pytest.raises(ValueError, match="no sweep layers"):
        zoo.trace_sweep(cpu=True, kinds=("nosuchkind",))

    profiles = load_profiles()
    measured = spec("cpu").replace(name="cpu:0", origin="measured")
    profiles = profiles.replace_devices({**profiles.devices, "cpu:0": measured})
    lines = []
    alone = _fitted(profiles, ["sweep"], quick=True, progress=lines.append)
    assert alone.devices["cpu:0"] == measured  # four layers fit no CPU
    assert any("nothing to fit a CPU on" in line for line in lines)

    def fit(names):
        return _fitted(profiles, names, quick=True, progress=lambda _: None).devices["cpu:0"]

    zoo_only, with_sweep = fit(["conv6", "lm_embed"]), fit(["conv6", "lm_embed", "sweep"])
    assert with_sweep.efficiencies == zoo_only.efficiencies  # the roofline never saw them
    assert sorted(r["layer"] for r in with_sweep.benchmarks["fit_layers"]
                  if r["model"] == "sweep") == sorted(graph.layers)
    if with_sweep.layer_model:  # kept by the left-out choice: tr fitted, not borrowed
        assert with_sweep.layer_model["flops_tr"] != with_sweep.layer_model["flops_conv"]


def test_a_patch_embedding_forward_is_a_conv_not_a_weight_gradient():
    """A ViT's 16x16 stride-16 patch embedding: its output (2x2 per image
    here) is smaller than its kernel, like a weight gradient's, yet it is a
    forward convolution; its weight gradient is the `wgrad`."""
    class Patches(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Conv(8, (16, 16), strides=(16, 16), padding="VALID", name="embed")(x)

    model = Patches()
    x = jnp.ones((2, 32, 32, 3))
    params = model.init(jax.random.PRNGKey(0), x)

    def step(params, x):
        grads = jax.grad(lambda p: (model.apply(p, x) ** 2).mean())(params)
        return jax.tree_util.tree_map(lambda a, g: a - 0.1 * g, params, grads)

    g = hetpar.trace(step, params, x, depth=2)
    eqs = matmul_equations(g, _layer(g, "embed"))
    assert sorted(e.cls for e in eqs) == ["conv", "wgrad"]
    forward = next(e for e in eqs if e.cls == "conv")
    assert (forward.m, forward.n, forward.k) == (2 * 2 * 2, 8, 16 * 16 * 3)


def test_a_mixture_of_experts_grouped_matmul_is_priced():
    """`jax.lax.ragged_dot` (a mixture of experts' grouped matmul) counts as a
    dot: its FLOPs are not lost from the model."""
    def step(w, x, sizes):
        def loss(w):
            with hetpar.layer("experts"):
                return (jax.lax.ragged_dot(x, w, sizes) ** 2).mean()

        return w - 0.1 * jax.grad(loss)(w)

    g = hetpar.trace(step, jnp.ones((2, 16, 32)), jnp.ones((64, 16)),
                     jnp.array([24, 40], jnp.int32))
    eqs = matmul_equations(g, "experts")
    # the forward and the weight gradient (one group per row)
    assert sorted((e.m, e.n, e.k) for e in eqs) == [(16, 32, 64), (64, 32, 16)]
    assert all(e.cls == "dot" and e.flops == 2 * 64 * 32 * 16 for e in eqs)


def test_the_small_sweep_has_each_kind_at_the_small_configs_sizes():
    """`zoo.small_grid` (the probe's "many small layers" for a CPU,
    experiments/results/cpu_timing): one layer per spec, each of its kinds
    present, every layer's matmuls of the class its name says, convolutions
    of at most 128 channels, and the warps' gathers counted."""
    import hetpar
    from hetpar import zoo
    from hetpar.passes import leaf_equations

    specs = zoo.small_grid()
    graph = hetpar.trace(*zoo.sweep_step(specs))
    assert list(graph.layers) == [sp.name for sp in specs]
    convs = [sp for sp in specs if sp.name.split("_")[0] in ("conv", "depthwise", "transposed")]
    assert convs and all(max(sp.params["w"][2:] + sp.x[3:]) <= 128 for sp in convs)
    kinds = {la.split("_")[0] for la in graph.layers}
    assert kinds == {"conv", "depthwise", "transposed", "maxpool", "dense", "layernorm",
                     "attention", "embedding", "elementwise", "reduction", "warp"}
    want = {"conv": "conv", "depthwise": "dw", "transposed": "tr", "dense": "dot"}
    for la in graph.layers:
        eqs = matmul_equations(graph, la)
        kind = la.split("_")[0]
        if kind in want:
            assert want[kind] in {e.cls for e in eqs}, la
            assert max(e.n for e in eqs) <= 4096
        if kind == "warp":
            prims = {e.primitive.name for e, *_ in leaf_equations(
                [graph.program.eqns[i] for i in graph[la].eqns])}
            assert "gather" in prims, (la, prims)
