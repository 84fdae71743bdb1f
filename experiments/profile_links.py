"""Does a `hetpar profile` file price the transfer engine's copies? (issue 17)

A cost table built from a profile file prices each link by the path the
transfer engine takes, its samples as a curve (`LinkProfile.copy_curve`,
`resolve_links`). This times the engine's copies of fresh arrays (as a
plan's values are: just computed) CPU device <-> GPU at sizes between the
profile's samples, GPT-2's among them (6 MB activations, 27 MiB block
weights, 57 MB, 154 MB embedding), and sets beside each what the table
predicts three ways: the curve through every sample, a curve through the
samples at powers of four only (the ladder profiles had before: 4 KB,
16 KB, ... 64 MiB, 256 MiB) and the straight line fitted through them.

    python -m hetpar profile --out P.json
    python experiments/profile_links.py --profiles P.json --out DIR
    python experiments/profile_links.py --profiles P.json --out DIR \
        --rescore OLD/profile_links.json      # price saved copies again, no devices

Writes DIR/profile_links.json and DIR/profile_links.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp

from hetpar.core import Link
from hetpar.cost_models import device_name, load_profiles, resolve_devices, resolve_links
from hetpar.runtime import TransferEngine

MIB = 1 << 20
SIZES_MIB = (1.5, 3, 6, 12, 20, 27, 30, 40, 57, 100, 154, 200)


def _fresh(dev, n: int):
    """count -> a fresh float32 array of `n` on `dev` per call (a just-computed value)."""
    make = jax.jit(lambda s: jnp.full((n,), s, jnp.float32),
                   out_shardings=jax.sharding.SingleDeviceSharding(dev))
    seed = iter(range(1, 1 << 30))
    return lambda: jax.block_until_ready(make(float(next(seed))))


def _engine_s(engine, src, dst, nbytes: int, runs: int) -> float:
    """Median seconds of the engine's copy of a fresh `nbytes` array `src` -> `dst`."""
    fresh = _fresh(src, nbytes // 4)
    jax.block_until_ready(engine.move(fresh(), dst))  # warm-up
    times = []
    for _ in range(runs):
        x = fresh()
        t0 = time.perf_counter()
        jax.block_until_ready(engine.move(x, dst))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _powers_of_four(lk):
    """`lk` with only its samples at 4 KB x 4^i."""
    keep = {4096 * 4**i for i in range(12)}
    return dataclasses.replace(lk, samples=tuple((b, t) for b, t in lk.samples
                                                 if int(b) in keep))


def _prices(profiles, a: str, b: str, path: str) -> dict[str, Link]:
    """The three ways a table could price `path` a -> b: the table's own link
    (the curve through every sample), the curve through the powers of four,
    and the fitted line."""
    devs = resolve_devices([a, b], profiles)
    table = {(k.src, k.dst): k for k in resolve_links(devs, profiles, [6e6, 28e6])}
    lk = next(lk for lk in profiles.links_between(a, b) if lk.path == path)
    coarse = _powers_of_four(lk).copy_curve()
    return {"curve_s": table[(a, b)],
            "coarse_curve_s": Link(a, b, lk.bandwidth_bytes_per_s, lk.latency_s, coarse),
            "line_s": Link(a, b, lk.bandwidth_bytes_per_s, lk.latency_s)}


def _priced(rows, profiles) -> list[dict]:
    """`rows` with each way's three predictions from `profiles`."""
    out, prices = [], {}
    for r in rows:
        a, b = r["way"].split(" -> ")
        if r["way"] not in prices:
            prices[r["way"]] = _prices(profiles, a, b, r["path"])
        out.append(r | {k: link.seconds(r["bytes"]) for k, link in prices[r["way"]].items()})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", required=True, help="a `hetpar profile` file of this machine")
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rescore", default=None,
                    help="a profile_links.json: price its measured copies again from "
                         "--profiles with this code, no devices needed")
    args = ap.parse_args(argv)
    profiles = load_profiles(args.profiles)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.rescore:
        saved = json.loads(pathlib.Path(args.rescore).read_text())
        rows = _priced(saved["rows"], profiles)
        (out / "profile_links.md").write_text(_markdown(rows, saved["device"]))
        print(_markdown(rows, saved["device"]))
        return 0
    cpu = jax.devices("cpu")[0]
    # Without a GPU (a smoke run): a second virtual CPU device stands in.
    gpu = jax.devices()[0] if jax.default_backend() == "gpu" else jax.devices("cpu")[1]
    names = {cpu: device_name(cpu), gpu: device_name(gpu)}
    engine = TransferEngine()
    rows = []
    for src, dst in ((cpu, gpu), (gpu, cpu)):
        a, b = names[src], names[dst]
        path = engine.path(src, dst)
        for mib in SIZES_MIB:
            n = int(mib * MIB) // 4096 * 4096
            took = _engine_s(engine, src, dst, n, args.runs)
            row, = _priced([{"way": f"{a} -> {b}", "path": path, "bytes": n,
                             "measured_s": took}], profiles)
            rows.append(row)
            print(f"{a} -> {b} [{path}] {mib:>6} MiB: measured {took * 1e3:8.3f} ms, "
                  f"curve {row['curve_s'] * 1e3:8.3f}, powers of 4 "
                  f"{row['coarse_curve_s'] * 1e3:8.3f}, line {row['line_s'] * 1e3:8.3f}",
                  flush=True)
    device = f"{gpu.device_kind} + its host's CPU device, jax {jax.__version__}"
    (out / "profile_links.json").write_text(json.dumps(
        {"device": device, "profiles": str(args.profiles), "runs": args.runs,
         "rows": rows}, indent=1))
    (out / "profile_links.md").write_text(_markdown(rows, device))
    print(_markdown(rows, device))
    return 0


def _markdown(rows, device: str) -> str:
    def err(p, m):
        return p / m - 1

    lines = [f"# A profile file's link prices against the engine's copies ({device})", "",
             "Error: predicted / measured - 1; each measured figure the median of fresh "
             "arrays' copies.", "",
             "| way | MiB | measured ms | curve | error | powers-of-4 curve | error "
             "| line | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["measured_s"]
        lines.append(
            f"| {r['way']} | {r['bytes'] / MIB:.1f} | {m * 1e3:.3f} "
            + " ".join(f"| {r[k] * 1e3:.3f} | {err(r[k], m):+.0%}"
                       for k in ("curve_s", "coarse_curve_s", "line_s")) + " |")
    lines.append("")
    for way in sorted({r["way"] for r in rows}):
        mine = [r for r in rows if r["way"] == way]
        med = {k: statistics.median(abs(err(r[k], r["measured_s"])) for r in mine)
               for k in ("curve_s", "coarse_curve_s", "line_s")}
        worst = {k: max(abs(err(r[k], r["measured_s"])) for r in mine) for k in med}
        lines.append(f"- {way}: median |error| curve {med['curve_s']:.0%} (worst "
                     f"{worst['curve_s']:.0%}), powers-of-4 curve {med['coarse_curve_s']:.0%} "
                     f"({worst['coarse_curve_s']:.0%}), line {med['line_s']:.0%} "
                     f"({worst['line_s']:.0%})")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
