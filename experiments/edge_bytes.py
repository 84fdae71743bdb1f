"""Bytes crossing between layers: glue's gradient with its forward, or not.

hetpar's layering rule 3 (`hetpar.passes._layers`) puts an unnamed equation
(glue between modules: a max-pool in the model's own code, a flatten) in
the layer of its producer. Since 2026-11-27 a backward equation takes the
earliest producing layer instead of the latest, so glue's gradient joins
the layer its forward joined. This traces zoo models at their reference
configs (tracing only, no device) and sums every edge's forward and
backward bytes (`LayerGraph.graph`), both ways.

    python experiments/edge_bytes.py --out experiments/results/layer_edges/edge_bytes.md
"""

from __future__ import annotations

import argparse
import pathlib

MODELS = ("alexnet", "vgg16", "resnet18", "resnet50", "mobilenet_v1", "conv6",
          "cyclegan_generator", "cnn_preprocess", "transformer")


def edge_bytes(model: str) -> float:
    from hetpar import zoo

    g = zoo.trace_model(model)[1]
    return sum(d["bytes"] + d["bytes_backward"] for _, _, d in g.graph.edges(data=True))


def main(argv=None) -> int:
    import hetpar.passes._layers as layers

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    now = {m: edge_bytes(m) for m in MODELS}
    real = layers.is_backward
    layers.is_backward = lambda stack: False  # rule 3 as before: the latest, forward or not
    try:
        before = {m: edge_bytes(m) for m in MODELS}
    finally:
        layers.is_backward = real
    lines = ["| model (reference config) | edge bytes, latest producer | glue's gradient with "
             "its forward | change |", "|---|---|---|---|"]
    lines += [f"| {m} | {before[m] / 1e6:.1f} MB | {now[m] / 1e6:.1f} MB | "
              f"{now[m] / before[m] - 1:+.0%} |" for m in MODELS]
    text = "\n".join(lines) + "\n"
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
