"""`hetpar profile`: measure the devices present and write a profile file."""

from __future__ import annotations

import sys

from hetpar.cli._common import add_link_arg, parse_links
from hetpar.core import HetparError

#: The models `--fit default` times: dense, convolutional, embedding and
#: attention layers (the training split of experiments/cost_accuracy.py,
#: `TRAIN_MODELS`, which every offline figure was fitted on), and the layer
#: sweep (`hetpar.zoo.trace_sweep`: 55 single-kind layers over a grid of
#: sizes on accelerators; on a CPU only `CPU_SWEEP_KINDS`). resnet50 was
#: missing until 2026-11-27: its bottleneck blocks (1x1 convolutions,
#: strided weight gradients, batch norms) are what a CPU's fit needs for
#: residual networks; without it the hosts' held-out CPU medians were 20%
#: and 29% offline, 11% and 18% with it (experiments/results/layer_model).
FIT_MODELS = ("alexnet", "conv6", "lm_embed", "mobilenet_v1", "resnet50", "transformer",
              "sweep")

#: The sweep's layers a CPU is fitted on: the kinds the zoo's fit models lack.
CPU_SWEEP_KINDS = ("transposed",)


def register(subparsers) -> None:
    """Adds the `profile` sub-command."""
    p = subparsers.add_parser(
        "profile",
        help="measure the devices present (FLOP/s, bandwidth, dispatch, transfers)",
        description=(
            "Measure every device present (jax.devices() plus the CPU): matmul FLOP/s, "
            "memory bandwidth, dispatch overhead, and transfer time for every ordered "
            "device pair and path; and what devices run together: the collectives of each "
            "group of two or more of one kind, and the copies between the accelerators and "
            "their pinned host memory with all copying at once. The file written overrides "
            "the built-in spec sheets. "
            "Run under several JAX processes (python -m hetpar.launch -n 2 \"$(which hetpar)\" "
            "profile, or a cluster launcher), it also times a transfer between every pair of "
            "processes (the network link); process 0 writes the file."
        ),
    )
    p.add_argument("--out", default="profiles.json", help="file to write (default %(default)s)")
    p.add_argument(
        "--quick", action="store_true", help="small sizes, few repetitions (transfers <= 16 MB)"
    )
    p.add_argument(
        "--devices",
        default=None,
        help="comma-separated devices to measure (e.g. cpu:0,gpu:0; p0/gpu:0,p1/gpu:0 under "
             "several processes, each measuring its own); default: all present",
    )
    p.add_argument(
        "--fit", default=None, metavar="MODELS",
        help="also time every layer of these zoo models on each device measured and fit its "
             "efficiencies, per-call costs and per-equation layer model to them (what a "
             f"spec-sheet sibling borrows): 'default' is {','.join(FIT_MODELS)} (reference "
             "configs on accelerators, small ones at batch 32 on the CPU; 'sweep': "
             "single-kind layers over a grid of sizes; a CPU times only its transposed "
             "convolutions)")
    p.add_argument("--no-transfers", action="store_true",
                   help="skip the device-pair transfers (and, across processes, the network)")
    add_link_arg(p)
    p.set_defaults(func=_run)


def _run(args) -> int:
    links = parse_links(args.link)  # checked before anything is measured

    # Join the job when started by hetpar.launch (or with a cluster's
    # variables); a plain run stays one process. Before any other JAX call.
    from hetpar._distributed import abort, initialize

    initialize()
    import jax

    try:
        return _measure(args, links, jax.process_index())
    except HetparError as e:
        if jax.process_count() <= 1:
            raise
        # sys.exit would wait at JAX's exit barrier while the other processes
        # wait for this one: leave at once (docs/distributed.md, `abort`).
        print(f"hetpar profile: error (process {jax.process_index()}): {e.for_cli()}",
              file=sys.stderr)
        abort(2)
        raise  # not reached


def _measure(args, links, process: int) -> int:
    from hetpar.cost_models import profile_devices, save_profiles, summary_table
    from hetpar.runtime import place_line

    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None
    fit = _fit_models(args.fit) if args.fit else None  # checked before anything is measured

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    profiles = profile_devices(
        devices, quick=args.quick, transfers=not args.no_transfers, progress=progress
    )
    if fit:
        profiles = _fitted(profiles, fit, quick=args.quick, progress=progress)
    if not args.no_transfers:
        profiles = _measured_together(profiles, progress)
    if links:
        profiles = profiles.with_network_links(links)
    if process != 0:
        # Every process holds the same profiles; one file is enough.
        print(f"process {process}: done; process 0 writes {args.out}")
        return 0
    save_profiles(args.out, profiles)
    print(summary_table(profiles))
    for group, ring in (profiles.meta.get("collectives") or {}).items():
        print(f"collectives over {group}: a ring step at "
              f"{ring['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, {ring['latency_s'] * 1e6:.0f} us")
    for group, place in (profiles.meta.get("place_links") or {}).items():
        print(f"pinned host memory of {group}, all at once: {place_line(place)}")
    for name, prof in profiles.devices.items():
        if "layer_model" in prof.sources:  # what --fit chose for unmeasured layers
            print(f"{name}: per-equation layer model {prof.sources['layer_model']}")
    print(f"wrote {args.out}")
    return 0


def _measured_together(profiles, progress):
    """`profiles` with what its measured devices ran together, in its `meta`
    (`hetpar.cost_models._group_figures`): the ring of each group of two or
    more devices of one kind (an all-gather and a reduce-scatter timed over
    them), and the copies between the accelerators and their pinned host
    memory with all of them copying both ways at once. A plan made from the
    file elsewhere prices sharded state and streamed state on these, as the
    first call's calibration does here. One process's devices only (across
    processes the network links stand for them)."""
    import dataclasses

    import jax

    from hetpar.cost_models import has_pinned_host, present_devices
    from hetpar.runtime import place_link_figures, ring_figures

    if jax.process_count() > 1:
        return profiles
    present = present_devices()
    mine = {n: present[n] for n, p in profiles.devices.items()
            if p.origin == "measured" and n in present}
    kinds: dict = {}
    for n, d in mine.items():
        kinds.setdefault((d.platform, d.device_kind), []).append(n)
    meta = dict(profiles.meta)

    def timed(what: str, measure):
        progress(f"timing {what}")
        try:
            return measure()
        except Exception as e:  # noqa: BLE001 - an extra figure: keep the profile
            progress(f"  could not time {what} ({type(e).__name__}: "
                     f"{str(e).splitlines()[0][:200]}); left out")
            return None

    rings = {}
    for names in kinds.values():
        if len(names) >= 2:
            names = sorted(names)
            got = timed(f"collectives over {'+'.join(names)}",
                        lambda names=names: ring_figures([mine[n] for n in names]))
            if got is not None:
                rings["+".join(names)] = {"bandwidth_bytes_per_s": float(got[0]),
                                          "latency_s": float(got[1])}
    if rings:
        meta["collectives"] = rings
    owners = sorted(n for n, d in mine.items() if d.platform != "cpu" and has_pinned_host(d))
    if owners:
        each_way = timed(f"copies to and from the pinned host memory of {'+'.join(owners)}, "
                         "all at once", lambda: place_link_figures([mine[n] for n in owners]))
        if each_way:
            meta["place_links"] = {"+".join(owners): {**each_way, "at_once": len(owners)}}
    return dataclasses.replace(profiles, meta=meta)


def _fit_models(text: str) -> list[str]:
    """--fit's zoo models ("default": `FIT_MODELS`)."""
    from hetpar import zoo

    names = list(FIT_MODELS) if text == "default" else [
        m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in zoo.names() and m != "sweep"]
    if unknown or not names:
        raise HetparError(f"--fit: unknown zoo models {unknown or text!r}; known: "
                          f"{', '.join(zoo.names())}, 'sweep' (or 'default')")
    return names


def _fitted(profiles, names: list[str], *, quick: bool, progress):
    """`profiles` with every measured present device's efficiencies fitted on the
    layers of the zoo models `names`."""
    from hetpar import zoo
    from hetpar.cost_models import LAYER_RUNS, fit_on_layers, present_devices

    present = present_devices()
    fitted = dict(profiles.devices)
    for name, prof in profiles.devices.items():
        if prof.origin != "measured" or name not in present:
            continue
        dev = present[name]
        cpu = dev.platform == "cpu"
        # On a CPU only the sweep's transposed convolutions, the kind the zoo's
        # fit models lack, and for the layer model only: fitted with the whole
        # sweep, the layer model predicted an H100 host's held-out zoo layers
        # at 50% median, 8-13% without it. The transposed ones move only their
        # own class's coefficients (each fit model left out: the same 24% and
        # 31% on the hosts' records), where the class had borrowed the
        # convolutions': held-out p90 53% -> 49% and 66% -> 52% there, and at
        # reference sizes XLA's CPU runs a transposed convolution ~200x slower
        # per FLOP than a convolution (experiments/results/layer_model). The
        # roofline has one convolution efficiency, which they would drag.
        graphs = [(m, zoo.trace_sweep(cpu=quick) if m == "sweep" else
                   zoo.trace_model(m, small=cpu or quick, batch=32 if cpu else None)[1])
                  for m in names if not (cpu and m == "sweep")]
        if not graphs:
            progress(f"{name}: --fit {','.join(names)} has nothing to fit a CPU on (the "
                     "sweep gives a CPU's layer model its transposed convolutions only, "
                     "beside zoo models); left as measured")
            continue
        sweep = ([("sweep", zoo.trace_sweep(cpu=True, kinds=CPU_SWEEP_KINDS))]
                 if cpu and "sweep" in names else [])
        progress(f"fitting {name} on the layers of {', '.join(names)}")
        # Each layer's lower quartile of up to LAYER_RUNS calls, as measured
        # layers are planned with: two runs agree to 7-8% median that way, to
        # 9-12% with the median of 10 (experiments/results/measure_repro).
        fitted[name] = fit_on_layers(prof, dev, graphs, k=3 if quick else LAYER_RUNS,
                                     progress=progress, layer_model_only=sweep)
    return profiles.replace_devices(fitted)
