"""Step timing and host naming shared by the benchmark scripts in this folder."""

import json
import platform
import statistics
import time

import jax


def median_step(step, state, batch, steps: int) -> tuple[float, tuple]:
    """Runs `steps` training steps, blocking on each loss.

    Args:
      step: `step(*state, batch) -> (*new_state, loss)`.
      state: the state arguments (e.g. `(variables, opt_state)`).
      batch: the batch argument.
      steps: how many steps to time.

    Returns:
      (median seconds per step, the state after the last step).
    """
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        *state, loss = step(*state, batch)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), tuple(state)


def write_results(prefix: str, markdown: str, results: dict) -> None:
    """Prints the markdown report and writes it and the JSON results beside each other."""
    print(markdown)
    with open(prefix + ".md", "w") as f:
        f.write(markdown)
    with open(prefix + ".json", "w") as f:
        json.dump(results, f, indent=1, default=str)


def host_cpu() -> str:
    """The host CPU's model name, for a results file's header."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
