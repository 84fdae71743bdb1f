"""Plots a runtime timeline (per-device busy intervals) from a benchmark's timelines JSON.

Each bar is one stage run (forward, backward or update; shade by microbatch),
from the executor's own events (`Executor.record_events`); watched timelines
(`Executor.watch_events`) add rows for each device's copies in and out. Usage:
  python experiments/plot_timeline.py \
      --timelines experiments/results/two_gpus_h200x2_timelines.json \
      --key "transformer M=4 1f1b half/half" --out experiments/results/timeline.png
"""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("timelines", None, "timelines JSON written by a benchmark", required=True)
flags.DEFINE_multi_string("key", None, "which timeline(s) to draw (default: all)")
flags.DEFINE_string("out", "experiments/results/timeline.png", "PNG to write")
flags.DEFINE_string("title", "", "figure title (say which card)")

_WHAT = ("copy in", "compute", "copy out")
_COLORS = {"forward": "tab:blue", "backward": "tab:orange", "post": "tab:green",
           "main": "tab:purple", "pre": "tab:gray"}


def main(argv):
    del argv
    data = json.load(open(FLAGS.timelines))
    keys = FLAGS.key or list(data)
    fig, axes = plt.subplots(len(keys), 1, figsize=(11, 1.6 + 1.1 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        events = data[key]
        # One row per device and kind of work (compute, copy in, copy out).
        rows = sorted({(e["device"], e.get("what", "compute")) for e in events},
                      key=lambda r: (r[0], _WHAT.index(r[1]) if r[1] in _WHAT else 9))
        devices = [d if w == "compute" else f"{d} {w}" for d, w in rows]
        for e in events:
            y = rows.index((e["device"], e.get("what", "compute")))
            alpha = 1.0 if e["microbatch"] is None else 0.45 + 0.55 * ((e["microbatch"] % 4) / 3)
            ax.barh(y, (e["end_s"] - e["start_s"]) * 1e3, left=e["start_s"] * 1e3,
                    color=_COLORS.get(e["phase"], "k"), alpha=alpha, edgecolor="k", lw=0.3)
        ax.set_yticks(range(len(devices)), devices)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("ms since the step began")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    fig.legend(handles, list(_COLORS), loc="lower right", fontsize=8, ncol=5)
    if FLAGS.title:
        fig.suptitle(FLAGS.title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    fig.savefig(FLAGS.out, dpi=110)


if __name__ == "__main__":
    app.run(main)
