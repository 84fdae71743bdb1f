"""Bytes crossing between layers: glue's gradient with its forward, or not.

hetpar's layering rule 3 (`hetpar.passes._layers`) puts an unnamed equation
(glue between modules: a max-pool in the model's own code, a flatten) in
the layer of its producer. Since 2026-11-27 a backward equation takes the
earliest producing layer instead of the latest, so glue's gradient joins
the layer its forward joined (leaf glue, and only into a layer with a
backward of its own). This traces every zoo model at its reference config
(tracing only, no device) and reports, both ways, every edge's forward and
backward bytes summed (`LayerGraph.graph`) and each cut a pipeline could
make in layer order (the bytes crossing between the first k layers and the
rest): how many cuts carry less, how many more, and the largest change.
The old rule is emulated by making rule 3 see no backward (`is_backward`
patched; it also feeds the clustering of unnamed plain-JAX models, which
the zoo's Flax models do not use).

    python experiments/edge_bytes.py --out experiments/results/layer_edges/edge_bytes.md
"""

from __future__ import annotations

import argparse
import pathlib


def edge_bytes(model: str) -> tuple[float, list[float]]:
    """(every edge's bytes summed, the bytes across each prefix cut in layer order)."""
    from hetpar import zoo

    g = zoo.trace_model(model)[1]
    edges = [(u, v, d["bytes"] + d["bytes_backward"]) for u, v, d in g.graph.edges(data=True)]
    cuts = []
    for k in range(1, len(g.layers)):
        first = set(g.layers[:k])
        cuts.append(sum(b for u, v, b in edges if (u in first) != (v in first)))
    return sum(b for *_, b in edges), cuts


def main(argv=None) -> int:
    import hetpar.passes._layers as layers

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from hetpar import zoo

    models = zoo.names()
    now = {m: edge_bytes(m) for m in models}
    real = layers.is_backward
    layers.is_backward = lambda stack: False  # rule 3 as before: the latest, forward or not
    try:
        before = {m: edge_bytes(m) for m in models}
    finally:
        layers.is_backward = real
    lines = ["| model (reference config) | edge bytes before | now | change | cuts: fewer "
             "bytes / more / same | largest change of a cut |", "|---|---|---|---|---|---|"]
    for m in models:
        (b_sum, b_cuts), (n_sum, n_cuts) = before[m], now[m]
        fewer = sum(n < b for b, n in zip(b_cuts, n_cuts))
        more = sum(n > b for b, n in zip(b_cuts, n_cuts))
        worst = max(((n - b) / b if b else 0.0 for b, n in zip(b_cuts, n_cuts)),
                    key=abs, default=0.0)
        lines.append(f"| {m} | {b_sum / 1e6:.1f} MB | {n_sum / 1e6:.1f} MB | "
                     f"{n_sum / b_sum - 1:+.0%} | {fewer} / {more} / {len(b_cuts) - fewer - more}"
                     f" | {worst:+.0%} |")
    text = "\n".join(lines) + "\n"
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
