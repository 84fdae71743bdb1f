"""Accuracy of the calibrated roofline on the zoo's layers, per present device.

Measures every layer of every zoo model (the reference config and batch on
accelerators; the small config at batch 32 on the CPU, where full-size
models take minutes a step), calibrates the predictor on a fixed half of the
models (`TRAIN_MODELS`, `--train_models`) and reports its error on the
others: median and 90th-percentile absolute percentage error, overall and
for layers above 100 us. Goal: median <= 10%
for layers above 100 us (Habitat: 11.8%; Google's learned TPU model: ~13%).

    python experiments/cost_accuracy.py --out_dir experiments/results
    python experiments/cost_accuracy.py --records experiments/results/accuracy_h200.json

The second form recomputes the report from saved measurements (no device).
Records saved before the work counts had `buffers` and `io_bytes` get them
by re-tracing their model at the recorded config (`--refresh_work`, on by
default); records of layers the zoo no longer has are dropped and listed.
Records without after-fusion bytes or kernel counts get them where their
device's platform is present here (`--refresh_fused`, `--refresh_kernels`:
the CPU's, on any machine).

Each layer is also compiled alone for its device: XLA's `bytes accessed`
(after fusion) is recorded as `work.fused_bytes`, and the instructions of
the optimised HLO's entry computation as its kernel count. The report gives
the error with the after-fusion bytes (the predictor's default where known)
and with hetpar's unfused count; with launches counted one per layer, one
per unfused jaxpr equation, or one per kernel (`LAUNCH_MODELS`); and with
the convolutions' FLOP efficiency calibrated apart from the matmul class's
(`calibrate(fit_conv=True)`, not the default: mixed on random splits of the
models). Figures: experiments/README.md's "Roofline accuracy per layer" row.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from absl import app, flags, logging

from hetpar import zoo
from hetpar.core import ProfileError, seconds
from hetpar.cost_models import (
    FUSED_BYTES_CLASSES,
    LAYER_RUNS,
    DeviceProfile,
    LayerWork,
    calibrate,
    device_class,
    device_name,
    graph_layer_work,
    layer_kernels,
    layer_xla_cost,
    measure_layer,
    predict,
    present_devices,
    resolve_device,
    spec,
    spec_kind_of,
    spec_kinds,
)
from hetpar.zoo import trace_model

_OUT = flags.DEFINE_string("out_dir", "experiments/results", "where to write the report")
_TAG = flags.DEFINE_string("tag", None, "file tag (default: the accelerator's kind, else 'cpu')")
_RECORDS = flags.DEFINE_list("records", None, "recompute from these accuracy_*.json (merged)")
_BUDGET = flags.DEFINE_float("budget_s", 300.0, "stop starting new models after this long")
_K = flags.DEFINE_integer("k", LAYER_RUNS,
                         "timed runs per layer (at most; the time: lower quartile)")
_CPU_BATCH = flags.DEFINE_integer("cpu_batch", 32, "batch of the small configs on the CPU")
_MODELS = flags.DEFINE_list("models", None, "zoo models (default: all)")
_PLATFORMS = flags.DEFINE_list("platforms", None,
                               "measure only these platforms, e.g. gpu (default: every present)")
_REFRESH = flags.DEFINE_bool("refresh_work", True,
                             "recount the work of saved records that lack buffer counts")
_REFRESH_FUSED = flags.DEFINE_bool("refresh_fused", True,
                                   "add after-fusion bytes to saved records of platforms "
                                   "present here")
#: The calibration models, fixed before any fit (issue 17): every other
#: measured model is held out. It is the even half of the eleven zoo models
#: measured on the H200 (alexnet ... transformer, sorted); a record file of
#: fewer models keeps the same split, not a new halving of what it holds.
TRAIN_MODELS = ("alexnet", "conv6", "lm_embed", "mobilenet_v1", "resnet50", "transformer")

_TRAIN = flags.DEFINE_list("train_models", list(TRAIN_MODELS),
                           "models whose layers calibrate; every other measured model is held "
                           "out")
_REFRESH_KERNELS = flags.DEFINE_bool("refresh_kernels", True,
                                     "add kernel counts to saved records of platforms present "
                                     "here")


# -- the study: per-layer records, calibration, held-out error -------------------

#: How a layer's launches count in the calibrated model: one dispatch per
#: layer (its stage is one executable), one per unfused equation, or one per
#: kernel of the layer compiled for its device (records' `kernels`).
LAUNCH_MODELS = ("executable", "equations", "kernels")

#: Which byte count the bytes term uses: XLA's after-fusion bytes where the
#: record has them (`fused`), or hetpar's unfused count always (`unfused`).
BYTES_MODELS = ("fused", "unfused")


def layer_records(model: str, device, *, small: bool = False, batch: int | None = None,
                  k: int = LAYER_RUNS, progress: Callable[[str], None] | None = None,
                  ) -> list[dict[str, Any]]:
    """Measures every layer of a zoo model on one present device.

    Returns:
      One record per layer: model, layer, device, device kind, batch, the
      layer's work (`LayerWork.to_json`, with the after-fusion bytes on
      this device in `fused_bytes` when XLA gives them), XLA's cost analysis
      (`xla`, None for layers with loops), its unfused equation count, the
      kernels of the layer compiled for this device (`kernels`, None when
      the compile failed), and the measured median and IQR in seconds.
      `accuracy` reads these.
    """
    w, graph = trace_model(model, small=small, batch=batch)
    batch = w.config.get("batch_size")
    dev = resolve_device(device)
    out = []
    for name in graph.layers:
        info = graph[name]
        t = measure_layer(graph, name, dev, k=k)
        xla = layer_xla_cost(graph, name, dev.platform)
        work = graph_layer_work(graph, name)
        if xla is not None and xla.bytes_accessed is not None:
            work = dataclasses.replace(work, fused_bytes=xla.bytes_accessed)
        out.append({
            "model": model, "layer": name, "device": device_name(dev),
            "device_kind": dev.device_kind, "kind": spec_kind_of(dev),
            "batch": batch, "small": small,
            "work": work.to_json(),
            "xla": None if xla is None else dataclasses.asdict(xla),
            "equations": int(info.work.launches),
            "kernels": layer_kernels(graph, name, dev.platform),
            "measured_s": t.typical_s, "median_s": t.median_s, "iqr_s": t.iqr_s,
        })
        if progress:
            progress(f"{model}/{name} on {device_name(dev)}: {seconds(t.typical_s)}")
    return out


def _class_of(kind: str) -> str:
    try:
        return device_class(kind)
    except ProfileError:
        return "gpu" if kind in ("gpu", "cuda", "rocm") else kind


def record_work(record: Mapping[str, Any], launch_model: str = "executable",
                bytes_model: str = "fused") -> LayerWork:
    """The LayerWork of a record, launches and bytes counted as the models say."""
    data = dict(record["work"])
    if launch_model == "executable":
        data["launches"] = 1
    elif launch_model == "kernels":
        # A record without a count (a stale layer, a failed compile) is one launch.
        data["launches"] = max(1, record.get("kernels") or 1)
    else:
        data["launches"] = max(1, record["equations"])
    if bytes_model == "unfused" or _class_of(record.get("kind", "cpu")) not in FUSED_BYTES_CLASSES:
        data["fused_bytes"] = None
    return LayerWork.from_json(data)


def fit_layers(profile: DeviceProfile, records: Sequence[Mapping[str, Any]], *,
               launch_model: str = "executable", bytes_model: str = "fused",
               fit_conv: bool = False) -> DeviceProfile:
    """Calibrates `profile` on measured layers: per-class efficiencies and the launch cost.

    `fit_conv`: also the convolutions' own efficiency (`calibrate(fit_conv=True)`).
    """
    samples = [(record_work(r, launch_model, bytes_model), r["measured_s"]) for r in records]
    return calibrate(profile, samples, fit_overhead=True, fit_conv=fit_conv)


def _errors(profile: DeviceProfile, records, launch_model: str,
            bytes_model: str = "fused") -> np.ndarray:
    pred = np.array([predict(profile, record_work(r, launch_model, bytes_model))
                     for r in records])
    meas = np.array([r["measured_s"] for r in records])
    return np.abs(pred - meas) / meas


def _stats(err: np.ndarray) -> dict[str, Any]:
    if err.size == 0:
        return {"n": 0, "median_ape": None, "p90_ape": None}
    return {"n": int(err.size), "median_ape": float(np.median(err)),
            "p90_ape": float(np.percentile(err, 90))}


def accuracy(
    records: Sequence[Mapping[str, Any]],
    base: Mapping[str, DeviceProfile],
    train_models: Sequence[str],
    *,
    launch_model: str = "executable",
    bytes_model: str = "fused",
    threshold_s: float = 100e-6,
    fit_conv: bool = False,
) -> dict[str, Any]:
    """Held-out error of the calibrated roofline, per device.

    Args:
      records: from `layer_records`.
      base: device name -> profile to calibrate (its peaks stay fixed).
      train_models: models whose layers calibrate; the rest are held out.
      launch_model: one of `LAUNCH_MODELS`.
      bytes_model: one of `BYTES_MODELS`.
      threshold_s: the "large layer" cut (by measured time).
      fit_conv: calibrate the convolutions' FLOP efficiency apart from the
        matmul class's (`calibrate(fit_conv=True)`).

    Returns:
      `{device: {"train": ..., "test": ..., "test_large": ..., "uncalibrated_test": ...,
      "profile": calibrated efficiencies}}`, each a dict of n, median and
      90th-percentile absolute percentage error (as fractions).
    """
    out: dict[str, Any] = {}
    for dev in sorted({r["device"] for r in records}):
        rs = [r for r in records if r["device"] == dev]
        if launch_model == "kernels" and all(r.get("kernels") is None for r in rs):
            continue  # recorded without kernel counts: nothing to compare
        train = [r for r in rs if r["model"] in train_models]
        test = [r for r in rs if r["model"] not in train_models]
        if not train or not test:
            continue
        prof = fit_layers(base[dev], train, launch_model=launch_model, bytes_model=bytes_model,
                          fit_conv=fit_conv)
        large = [r for r in test if r["measured_s"] > threshold_s]
        out[dev] = {
            "kind": rs[0]["kind"], "device_kind": rs[0]["device_kind"],
            "train": _stats(_errors(prof, train, launch_model, bytes_model)),
            "test": _stats(_errors(prof, test, launch_model, bytes_model)),
            "test_large": _stats(_errors(prof, large, launch_model, bytes_model)),
            "uncalibrated_test_large": _stats(_errors(base[dev], large, launch_model,
                                                      bytes_model)),
            "efficiencies": {c: dict(e) for c, e in prof.efficiencies.items()},
            "fused_bytes_efficiency": prof.fused_bytes_efficiency,
            "conv_efficiency": prof.conv_efficiency,
            "with_fused_bytes": sum(r["work"].get("fused_bytes") is not None for r in rs),
            "launch_overhead_s": prof.launch_overhead_s,
            "buffer_overhead_s": prof.buffer_overhead_s,
            "train_models": sorted({r["model"] for r in train}),
            "test_models": sorted({r["model"] for r in test}),
        }
    return out


# -- the report ------------------------------------------------------------------


def _refresh(records, *, work: bool, fused: bool, kernels: bool):
    """Brings saved records up to today's fields, tracing each model once.

    `work`: recounts the work of records saved before buffer counts (dropping,
    and listing, layers the zoo no longer has) and adds `conv_flops` where it
    is missing. `fused`, `kernels`: adds XLA's after-fusion bytes (and `xla`),
    and kernel counts, to records of platforms present here, compiled here:
    for the CPU records of another host this assumes XLA fuses the same on
    both CPUs (same jax version).
    """
    import jax

    present = {d.platform for d in jax.devices()} | {"cpu"}
    graphs = {}
    out, dropped = [], []
    for r in records:
        platform = r["device"].split(":")[0]
        new_work = work and "buffers" not in r["work"]
        new_conv = work and "conv_flops" not in r["work"]
        new_xla = fused and "xla" not in r and platform in present
        new_kernels = kernels and r.get("kernels") is None and platform in present
        if not (new_work or new_conv or new_xla or new_kernels):
            out.append(r)
            continue
        key = (r["model"], r["small"], r["batch"])
        if key not in graphs:
            graphs[key] = trace_model(r["model"], small=r["small"], batch=r["batch"])[1]
        graph, name = graphs[key], r["layer"]
        if name not in graph.layers:
            if new_work:
                dropped.append(f"{r['model']}/{name} on {r['device']}")
            else:  # counted before conv_flops, a layer the zoo lost: it keeps 0
                out.append(r)
            continue
        r = dict(r)
        if new_work:
            r["work"] = graph_layer_work(graph, name).to_json()
        elif new_conv:
            r["work"] = dict(r["work"], conv_flops=graph_layer_work(graph, name).conv_flops)
        if new_xla:
            xla = layer_xla_cost(graph, name, platform)
            w = LayerWork.from_json(r["work"])
            if xla is not None and xla.bytes_accessed is not None:
                w = dataclasses.replace(w, fused_bytes=xla.bytes_accessed)
            r["work"], r["xla"] = w.to_json(), None if xla is None else dataclasses.asdict(xla)
        if new_kernels:
            r["kernels"] = layer_kernels(graph, name, platform)
        out.append(r)
    return out, dropped


def _base_profiles(records):
    out = {}
    for r in records:
        kind = r["kind"] if r["kind"] in spec_kinds() else ("cpu" if r["kind"] == "cpu" else "h100")
        out[r["device"]] = spec(kind).replace(name=r["device"])
    return out


def _measure_all(models, deadline):
    records, skipped = [], []
    devices = [d for d in present_devices().values()
               if not _PLATFORMS.value or d.platform in _PLATFORMS.value]
    for i, model in enumerate(models):
        if time.time() > deadline:
            skipped += models[i:]
            break
        for dev in devices:
            cpu = dev.platform == "cpu"
            try:
                records += layer_records(
                    model, dev, small=cpu, batch=_CPU_BATCH.value if cpu else None,
                    k=_K.value, progress=lambda m: logging.info("%s", m))
            except Exception as e:  # noqa: BLE001 - one model's failure must not end the report
                logging.warning("%s on %s failed: %s", model, device_name(dev), e)
    return records, skipped


def _markdown(result) -> str:
    lines = [f"# Cost-model accuracy: {result['host']}", "",
             f"jax {result['jax']}; measured {result['date']}; devices: "
             + ", ".join(f"{d} = {v}" for d, v in result["device_kinds"].items()), "",
             "Calibrated on the layers of: " + ", ".join(result["train_models"])
             + "; errors are on the held-out models: " + ", ".join(result["test_models"]) + ".",
             "APE = |predicted - measured| / measured. Goal: median <= 10% for layers "
             "above 100 us.", ""]
    lines += ["## Summary: held-out layers above 100 us, median / p90 APE", "",
              "| device | card | bytes | per executable | per equations | per kernel |",
              "|---|---|---|---|---|---|"]
    for bm, key in (("after fusion (XLA) on gpu/tpu, else unfused", "launch_models"),
                    ("unfused (hetpar)", "unfused_bytes"),
                    ("after fusion, convolutions' own efficiency", "conv_efficiency")):
        for dev in result["launch_models"].get("executable", {}):
            cells = []
            for lm in LAUNCH_MODELS:
                r = result.get(key, {}).get(lm, {}).get(dev)
                tl = r["test_large"] if r else None
                cells.append("-" if not tl or tl["median_ape"] is None else
                             f"{100 * tl['median_ape']:.1f}% / {100 * tl['p90_ape']:.1f}%")
            kind = result["device_kinds"].get(dev, "?")
            lines.append(f"| {dev} | {kind} | {bm} | " + " | ".join(cells) + " |")
    lines.append("")
    sections = [(f"after-fusion bytes, launches counted per {lm}", per_dev)
                for lm, per_dev in result["launch_models"].items()]
    sections += [(f"unfused bytes, launches counted per {lm}", per_dev)
                 for lm, per_dev in result.get("unfused_bytes", {}).items()]
    sections += [(f"after-fusion bytes, convolutions' own efficiency, launches counted per {lm}",
                  per_dev)
                 for lm, per_dev in result.get("conv_efficiency", {}).items()]
    for title, per_dev in sections:
        lines += [f"## {title}", "",
                  "| device | card | layers (test) | median APE | p90 APE | layers > 100 us |"
                  " median APE > 100 us | p90 APE > 100 us | uncalibrated median > 100 us |"
                  " train median |",
                  "|---|---|---|---|---|---|---|---|---|---|"]

        def pct(x):
            return "-" if x is None else f"{100 * x:.1f}%"

        for dev, r in per_dev.items():
            t, tl, u, tr = r["test"], r["test_large"], r["uncalibrated_test_large"], r["train"]
            lines.append(f"| {dev} | {r['device_kind']} | {t['n']} | {pct(t['median_ape'])} | "
                         f"{pct(t['p90_ape'])} | {tl['n']} | {pct(tl['median_ape'])} | "
                         f"{pct(tl['p90_ape'])} | {pct(u['median_ape'])} | "
                         f"{pct(tr['median_ape'])} |")
        lines.append("")
        effs = [f"{dev}: fused-bytes efficiency "
                + ("-" if r.get("fused_bytes_efficiency") is None
                   else f"{r['fused_bytes_efficiency']:.3f}")
                + f" ({r.get('with_fused_bytes', 0)} records with fused bytes), "
                + ("" if r.get("conv_efficiency") is None
                   else f"conv efficiency {r['conv_efficiency']:.3f}, ")
                + "launch "
                f"{seconds(r['launch_overhead_s'])}, buffer "
                f"{seconds(r.get('buffer_overhead_s', 0.0))}"
                for dev, r in per_dev.items()]
        lines += ["Fitted: " + "; ".join(effs) + ".", ""]
    if result.get("dropped_stale"):
        lines += [f"Dropped (layer no longer in the zoo): {', '.join(result['dropped_stale'])}", ""]
    if result.get("skipped"):
        lines += [f"Not measured (time budget): {', '.join(result['skipped'])}", ""]
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    import jax

    if _RECORDS.value:
        parts = [json.loads(pathlib.Path(p).read_text()) for p in _RECORDS.value]
        records, dropped = _refresh([r for part in parts for r in part["records"]],
                                    work=_REFRESH.value, fused=_REFRESH_FUSED.value,
                                    kernels=_REFRESH_KERNELS.value)
        all_models = sorted({r["model"] for r in records})
        result = dict(parts[0], records=records, dropped_stale=dropped,
                      device_kinds={r["device"]: r["device_kind"] for r in records},
                      skipped=sorted(set.intersection(
                          *(set(p.get("skipped", [])) for p in parts))))
    else:
        models = _MODELS.value or zoo.names()
        records, skipped = _measure_all(models, time.time() + _BUDGET.value)
        accel = [d for d in jax.devices() if d.platform != "cpu"]
        result = {
            "host": (accel[0].device_kind if accel else "CPU") + f", {os.cpu_count()} CPU cores",
            "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
            "device_kinds": {r["device"]: r["device_kind"] for r in records},
            "skipped": skipped, "records": records,
        }
        all_models = sorted({r["model"] for r in records})
    # The split is fixed before any fit (`TRAIN_MODELS`, `--train_models`).
    result["train_models"] = [m for m in all_models if m in _TRAIN.value]
    result["test_models"] = [m for m in all_models if m not in _TRAIN.value]
    base = _base_profiles(records)
    # Three sets of rows: bytes after fusion, unfused, and the convolutions' own efficiency.
    for key, bytes_model, fit_conv in (("launch_models", "fused", False),
                                       ("unfused_bytes", "unfused", False),
                                       ("conv_efficiency", "fused", True)):
        result[key] = {lm: accuracy(records, base, result["train_models"], launch_model=lm,
                                    bytes_model=bytes_model, fit_conv=fit_conv)
                       for lm in LAUNCH_MODELS}
    tag = _TAG.value or next((r["kind"] for r in records if r["kind"] != "cpu"), "cpu")
    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"accuracy_{tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    md = _markdown(result)
    (out / f"accuracy_{tag}.md").write_text(md)
    logging.info("wrote %s\n%s", out / f"accuracy_{tag}.md", md)


if __name__ == "__main__":
    app.run(main)
