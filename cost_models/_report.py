"""What a CostTable's figures mean per sample: seconds, dollars and joules (`hetpar costs`)."""

from __future__ import annotations

from hetpar.core import CostTable


def per_sample(table: CostTable, batch: int) -> dict[str, dict[str, dict[str, float]]]:
    """Per layer and device: seconds, dollars and joules per sample.

    Dollars use the device's plan price (`price_per_hour`), joules its busy
    power; both scale the layer's step time, divided by the batch size.

    Returns:
      `{layer: {device: {"time_s", "usd", "joules"}}}` per sample.
    """
    devs = {d.name: d for d in table.devices}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for layer in table.layers:
        row = {}
        for dev, t in layer.time_s.items():
            d = devs[dev]
            row[dev] = {"time_s": t / batch, "usd": t * d.price_per_hour / 3600 / batch,
                        "joules": t * d.watts_busy / batch}
        out[layer.name] = row
    return out
