"""Measuring one jit-able function on one device, with a disk cache.

`measure` compiles `jax.jit(fn)` for a device (its arguments are put there
first, so the computation follows them), warms it up, and times k calls with
`block_until_ready`: compile time is left out. `measure_step` times a
training step as a loop runs it (state threaded, the batch as given).
`measure_cached` keys a disk
cache by a caller-given fingerprint plus argument shapes and dtypes, the
device kind and the jax version, so a layer is measured once per machine.
`sweep_batch` measures one function family over several batch sizes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from absl import logging

from hetpar.core import ProfileError
from hetpar.cost_models._devices import resolve_device


@dataclasses.dataclass(frozen=True)
class Timing:
    """Measured run time of one function on one device.

    Attributes:
      median_s: median of the timed runs, seconds.
      iqr_s: interquartile range of the timed runs, seconds.
      typical_s (property): their lower quartile, the time a layer is
        planned with (see there).
      samples: every timed run, seconds.
      cached: True when read from the disk cache instead of measured.
      earlier: cached, from an entry this process did not write (a run
        before this one timed it): what progress lines call "cached". An
        entry timed in this run and read back (every layer timed together
        first, or a second device of the same kind) is not.
    """

    median_s: float
    iqr_s: float
    samples: tuple[float, ...]
    cached: bool = False
    earlier: bool = dataclasses.field(default=False, compare=False)

    @classmethod
    def of(cls, samples: Sequence[float]) -> Timing:
        """Summarises raw samples."""
        s = sorted(float(x) for x in samples)
        if len(s) >= 4:
            q = statistics.quantiles(s, n=4, method="inclusive")
            iqr = q[2] - q[0]
        else:
            iqr = s[-1] - s[0]
        return cls(statistics.median(s), iqr, tuple(samples))

    @property
    def typical_s(self) -> float:
        """The lower quartile of the timed runs, seconds: what one call takes
        when nothing else gets in its way. A host interrupt, a late thread
        wake-up or a clock step only ever add time, so the low runs are the
        reproducible ones: timed twice in separate processes, the zoo's layers
        agreed to a median of 7.0% / p90 21.4% this way (H200; 6.8% / 19.2%
        on its host CPU), against 9.8% / 28.0% (11.8% / 26.4%) for the median
        of 10 runs (experiments/results/measure_repro)."""
        s = sorted(self.samples) or [self.median_s]
        if len(s) < 2:
            return float(s[0])
        return float(statistics.quantiles(s, n=4, method="inclusive")[0])

    def to_json(self) -> dict[str, Any]:
        """Returns the JSON form (without `cached`)."""
        return {"median_s": self.median_s, "iqr_s": self.iqr_s, "samples": list(self.samples)}

    @classmethod
    def from_json(cls, data: dict[str, Any], *, cached: bool = False,
                  earlier: bool = False) -> Timing:
        """Builds a Timing from its JSON form."""
        return cls(
            float(data["median_s"]), float(data["iqr_s"]), tuple(data["samples"]), cached,
            earlier and cached,
        )


def measure(
    fn: Callable, args: Sequence[Any], device, *, k: int = 20, warmup: int = 3,
    budget_s: float | None = None,
) -> Timing:
    """Times `jax.jit(fn)(*args)` on `device`, compile time excluded.

    Args:
      fn: any jit-able function.
      args: its positional arguments (pytrees of arrays); they are put on
        `device` first, so the computation runs there.
      device: a JAX device or its name (`cpu:0`).
      k: timed runs; the median and IQR are reported.
      warmup: untimed runs first (at least 1: the first call compiles).
      budget_s: with it, fewer than k runs once the timed runs have taken
        this long (three at least): GPT-2's layers alone on a host CPU at
        batch 256 take about a second each, and k of every one kept
        `profile="measure"` of an offload plan busy for minutes.

    Returns:
      The Timing of the runs.

    Raises:
      ProfileError: the device is not present, or k < 1.
    """
    import jax

    if k < 1:
        raise ProfileError(f"measure: k must be >= 1, got {k}")
    dev = resolve_device(device)
    args = jax.device_put(tuple(args), dev)
    jitted = jax.jit(fn)
    for _ in range(max(1, warmup)):
        jax.block_until_ready(jitted(*args))
    samples = []
    for _ in range(k):
        t0 = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        samples.append(time.perf_counter() - t0)
        if budget_s is not None and len(samples) >= 3 and sum(samples) >= budget_s:
            break
    return Timing.of(samples)


def measure_step(
    fn: Callable, args: Sequence[Any], device, *, batch_argnums: Sequence[int] = (-1,),
    k: int = 20, warmup: int = 3, budget_s: float | None = None,
    jitted: Callable | None = None, donated: Sequence[int] = (),
) -> Timing:
    """Times `jax.jit(fn)` on `device` as a training loop runs it, compile time excluded.

    `device` may also be a sequence of devices: the step then runs data
    parallel over them as `hetpar.runtime.Replicated` runs it (the state
    replicated, each batch leaf with a leading axis split along it, scalars
    whole), its gradients all-reduced by XLA.

    The state (the arguments not in `batch_argnums`) is put on `device`; a
    NumPy batch stays as given and is copied in by every call, as a data
    loader's is; JAX arrays of the batch are put on `device` once, except,
    data parallel, uncommitted ones, which jit lays out every call. Where
    the step returns its state first (output i has the structure, shapes and
    dtypes of state argument i), each run takes the last one's outputs, as
    the loop does; the other arguments stay as given. Threading holds one
    more copy of the state where the caller's is on `device` (the caller's,
    the last run's, the new one; elsewhere the copy put here is let go after
    the first run); where it fails (out of memory) every run takes the same
    arguments. `measure`
    times the same arguments with everything on the device: GPT-2 small at
    batch 16 ran 19.5 ms that way and 23.1 ms threaded with a host batch on
    an H100, which a user's loop measured (22.7 ms,
    experiments/results/predictions_step_timing).

    Args:
      fn: the step, `fn(*state, batch) -> (*new_state, ...)` or any jit-able function.
      args: its positional arguments; the caller's arrays are not changed.
      device: a JAX device or its name, or a sequence of them (data parallel).
      batch_argnums: positions of the batch arguments (negative: from the end).
      k: timed runs.
      warmup: untimed runs first (at least 1: the first call compiles).
      budget_s: with it, fewer than k runs once the timed runs have taken
        this long (three at least), as for `measure`.
      jitted: on one device, `fn` already under `jax.jit` as the caller will
        run it later (the same executable then serves both: hetpar's
        one-device step compiles once for its calibration and its run).
      donated: the argument positions `jitted` donates: each run takes a
        copy of its own there (the caller's arrays are never given), the
        last run's outputs where threaded, else a fresh copy put before the
        run (outside its time). On the device the state then lives once
        beside the caller's: the copy, its outputs written over it.

    Returns:
      The Timing of the runs.
    """
    import jax

    if k < 1:
        raise ProfileError(f"measure_step: k must be >= 1, got {k}")
    prebuilt = jitted
    batch = {i % len(args) for i in batch_argnums} if args else set()
    state_at = [i for i in range(len(args)) if i not in batch]
    args = list(args)
    if isinstance(device, (str, jax.Device)):
        state_place = split = resolve_device(device)
        jitted = prebuilt or jax.jit(fn)
    else:  # data parallel: a 1-D mesh of replicas
        n = len(device)
        uneven = [np.shape(x) for i in batch for x in jax.tree_util.tree_leaves(args[i])
                  if np.ndim(x) and np.shape(x)[0] % n]
        if uneven:
            raise ProfileError(f"measure_step: a batch array of shape {uneven[0]} does not "
                               f"split over {n} replicas (its leading axis must divide)")
        mesh = jax.sharding.Mesh([resolve_device(d) for d in device], ("replica",))
        state_place = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("replica"))
        jitted = jax.jit(fn, in_shardings=tuple(
            jax.tree_util.tree_map(lambda x: split if getattr(x, "ndim", 0) else state_place,
                                   a) if i in batch else state_place
            for i, a in enumerate(args)), out_shardings=state_place)
    # JAX arrays of the batch committed elsewhere would not mix with the state:
    # moved once. Over replicas an uncommitted one (made with jnp on the
    # default device) stays: jit lays it out every call, as it does in the
    # user's loop under hetpar's data-parallel step (GPT-2 b64 on 2x H200:
    # 2.2 ms of the step that a batch split once left out,
    # experiments/results/dp_b64_h200x2).
    data_parallel = not isinstance(device, (str, jax.Device))

    def batch_leaf(x):
        if not isinstance(x, jax.Array) or (data_parallel and not x.committed):
            return x
        return jax.device_put(x, split if getattr(x, "ndim", 0) else state_place)

    donated = sorted({i % len(args) for i in donated}) if args else []
    if set(donated) & batch:
        raise ProfileError("measure_step: a donated batch argument would be given up by the "
                           "first run; time a jit that does not donate it")

    def put_state(at) -> dict:
        """Caller's state arguments `at`, put on the device: where donated, as
        copies of their own (a put may hand back the caller's own buffer,
        which donating would give up)."""
        plain = [i for i in at if i not in donated]
        mine = [i for i in at if i in donated]
        out = dict(zip(plain, jax.device_put([caller[i] for i in plain], state_place)))
        if mine:
            out.update(zip(mine, jax.device_put([caller[i] for i in mine], state_place,
                                                 may_alias=False)))
        return out

    def placed() -> list:
        out = list(caller)
        for i, x in put_state(state_at).items():
            out[i] = x
        for i in batch:
            out[i] = jax.tree_util.tree_map(batch_leaf, out[i])
        return out

    # The caller's arguments are kept (and placed again should threading run
    # out of memory), not the copy placed here: threaded, the first run's
    # outputs replace it, and with the caller's state on the host the GPU
    # then holds two states at once, not three (the HF 2.9B step's 35 GB
    # state peaked at 106 GB while calibrating on a 113 GB H200, where the
    # step itself peaks at 50: experiments/results/fit_h200, run 66).
    caller = list(args)
    args = placed()

    def placed_again(at: list) -> list:
        for i, x in put_state(at).items():
            args[i] = x
        return [args[i] for i in at]

    def spec(tree):
        leaves, structure = jax.tree_util.tree_flatten(tree)
        return structure, [(getattr(x, "shape", None), getattr(x, "dtype", None),
                            getattr(x, "weak_type", None)) for x in leaves]

    out = jax.block_until_ready(jitted(*args))  # compiles
    # Each state argument the step returns at its position (same structure,
    # shapes, dtypes and weak types: a loss is not a learning rate passed as a
    # Python float) takes the last run's output; the others stay as given.
    threaded = ([(n, i) for n, i in enumerate(state_at) if n < len(out)
                 and spec(out[n]) == spec(args[i])]
                if isinstance(out, (tuple, list)) else [])

    def runs(warm: int, thread: list) -> list[float]:
        nonlocal out
        samples, putting = [], 0.0
        fresh = [i for i in donated if i not in {i for _, i in thread}]
        for r in range(warm + k):
            for n, i in thread:  # the last run's state in, as the loop passes it
                args[i] = out[n]
            out = None  # (the last outputs, unless just passed in, go before the run)
            t0 = time.perf_counter()
            if fresh:  # donated and not threaded: the last run gave its copy up
                jax.block_until_ready(placed_again(fresh))
                putting += time.perf_counter() - t0  # (counts toward the budget, untimed)
                t0 = time.perf_counter()
            out = jax.block_until_ready(jitted(*args))
            if r >= warm:
                samples.append(time.perf_counter() - t0)
                if budget_s is not None and len(samples) >= 3 \
                        and sum(samples) + putting >= budget_s:
                    break
        return samples

    # One untimed threaded run at least: fed its own outputs, jit must not
    # compile again inside a timed run.
    try:
        return Timing.of(runs(max(1, warmup) - 1 + bool(threaded), threaded))
    except Exception:  # noqa: BLE001 - e.g. out of memory: threading holds one more state
        if not threaded:
            raise
    # The caller's state, the last run's and the new outputs were live at
    # once; the same arguments every run hold one state less. (Out of the
    # except block: its traceback held the failed run's inputs.)
    args[:], out = [], None
    args[:] = placed()
    return Timing.of(runs(max(1, warmup) - 1, []))


def batch_share(args: Sequence[Any], batch_argnums: Sequence[int], parts: int) -> tuple | None:
    """`args` with each batch argument's leading axis cut to its first 1/`parts`
    (what one of `parts` data-parallel replicas runs; scalars whole), or None
    where a batch leaf's leading axis does not divide or nothing has one."""
    import jax

    batch = {i % len(args) for i in batch_argnums}
    out = list(args)
    for i in batch:
        # Scalars (a learning rate passed as batch) go to every replica whole.
        leaves, tree = jax.tree_util.tree_flatten(args[i])
        cut = [x for x in leaves if getattr(x, "shape", ())]
        if not cut or any(x.shape[0] % parts for x in cut):
            return None
        out[i] = jax.tree_util.tree_unflatten(tree, [
            x[: x.shape[0] // parts] if getattr(x, "shape", ()) else x for x in leaves])
    return tuple(out)


def cache_dir() -> pathlib.Path:
    """`$HETPAR_CACHE_DIR`, else `~/.cache/hetpar`."""
    env = os.environ.get("HETPAR_CACHE_DIR")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "hetpar"


def cache_key(key: str, args: Sequence[Any], device) -> str:
    """The cache key: fingerprint, argument shapes and dtypes, device kind, jax version."""
    import jax

    dev = resolve_device(device)
    leaves = jax.tree_util.tree_leaves(tuple(args))
    sig = [(tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)))
           for x in leaves]
    text = json.dumps([key, sig, dev.platform, dev.device_kind, jax.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def measure_cached(
    key: str,
    fn: Callable,
    args: Sequence[Any],
    device,
    *,
    k: int = 20,
    warmup: int = 3,
    budget_s: float | None = None,
    measure_fn: Callable[..., Timing] | None = None,
) -> Timing:
    """`measure`, remembered on disk.

    Args:
      key: the caller's fingerprint of `fn` (e.g. a layer's jaxpr hash); the
        cache also keys on argument shapes and dtypes, the device kind and
        the jax version, so a change of any of them measures again.
      fn, args, device, k, warmup, budget_s: as for `measure`.
      measure_fn: what to call on a miss (default `measure`; tests count calls).

    Returns:
      The Timing; `cached` is True when no measurement ran. An entry of
      fewer runs than k that did not run out of `budget_s` (a `--k 3`, or
      10 runs before `LAYER_RUNS` was 40) is measured again.
    """
    digest = cache_key(key, args, device)
    cached = []

    def timed() -> dict:
        extra = {} if budget_s is None else {"budget_s": budget_s}
        timing = (measure_fn or measure)(fn, args, device, k=k, warmup=warmup, **extra)
        cached.append(False)
        return timing.to_json() | {"key": key, "k": k}

    data = cached_json("measure", digest, timed, required=("median_s", "iqr_s", "samples"),
                       valid=lambda d: _enough(d, k, budget_s))
    return Timing.from_json(data, cached=not cached, earlier=_from_before("measure", digest))


#: Arguments of at most this many bytes, summed, are on a device at once
#: while `measure_interleaved` times a group (a larger set is timed in
#: groups; one larger than this alone).
INTERLEAVE_BYTES = 2 * 2**30


@dataclasses.dataclass(frozen=True)
class Timed:
    """One function for `measure_interleaved`: its cache fingerprint (as
    `measure_cached`'s key), itself, the shapes and dtypes of its arguments,
    and a call that draws the arguments (only on a cache miss)."""

    key: str
    fn: Callable
    shapes: Sequence[Any]
    draw: Callable[[], Sequence[Any]]
    name: str = ""  # for messages: the layer


def measure_interleaved(items: Sequence[Timed], device, *, k: int = 20, warmup: int = 3,
                        budget_s: float | None = None) -> list[Timing]:
    """Times several functions on one device in rounds, one call of each per
    round (each until it has k runs, or three once they took `budget_s`),
    remembered on disk as `measure_cached` remembers one (entries marked
    "interleaved").

    A function timed after the others, as a step runs it, not after itself:
    on a 16-core host CPU back-to-back runs of small layers came out up to
    2.9x faster (median 1.2x) than interleaved with the rest, and two
    interleaved passes over the zoo's layers agreed to a p10-p90 of
    0.91-1.04 against 0.82-1.15 back to back: drift on the host, bursts of
    other work, falls on every layer alike instead of on whichever layer was
    being timed (experiments/results/cpu_timing).

    Cached entries are read, not timed again; the rest are compiled, warmed
    up and timed together (`_time_group`), in groups of at most
    `INTERLEAVE_BYTES` of arguments on the device.

    Returns:
      The Timings, in the order of `items`.
    """
    if k < 1:
        raise ProfileError(f"measure_interleaved: k must be >= 1, got {k}")
    dev = resolve_device(device)
    out: list[Timing | None] = [None] * len(items)
    digests = [cache_key(it.key, it.shapes, dev) for it in items]
    # Asked for among others, an entry timed alone (back to back: a call with
    # nothing else to alternate with, `measure_layer` on its own) is not it.
    alone = len(set(digests)) == 1

    def enough(d: dict) -> bool:
        return _enough(d, k, budget_s) and (alone or not d.get("alone", False))

    first: dict[str, int] = {}  # one timing per digest: identical layers (VGG's) share it
    for i, digest in enumerate(digests):
        if digest in first:
            continue
        first[digest] = i
        data = _cache_read("measure", digest, ("median_s", "iqr_s", "samples"), enough)
        if data is not None:
            out[i] = Timing.from_json(data, cached=True, earlier=_from_before("measure", digest))
    todo = [i for i in first.values() if out[i] is None]
    for group in _groups(todo, [_nbytes(items[i].shapes) for i in todo]):
        samples = _time_group([items[i] for i in group], dev, k=k, warmup=warmup,
                              budget_s=budget_s)
        for i, s in zip(group, samples, strict=True):
            timing = Timing.of(s)
            _cache_write("measure", digests[i], timing.to_json() | {
                "key": items[i].key, "k": k, "protocol": "interleaved", "alone": alone})
            out[i] = timing
    return [out[first[d]] for d in digests]  # type: ignore[misc]


def _time_group(items: Sequence[Timed], dev, *, k: int, warmup: int,
                budget_s: float | None) -> list[list[float]]:
    """Each function's timed runs, in rounds of one call of each (compiled and
    warmed up first); a function leaves the rounds at k runs, or at three
    once they took `budget_s`. When one is left, the quickest that left
    runs between its calls, untimed, so that it never follows itself.

    Raises:
      ProfileError: a function failed to compile or run (named).
    """
    import jax

    runs = []
    for it in items:
        try:
            args = jax.device_put(tuple(it.draw()), dev)
            jitted = jax.jit(it.fn)
            for _ in range(max(1, warmup)):
                jax.block_until_ready(jitted(*args))
        except Exception as e:  # noqa: BLE001 - name what failed
            raise ProfileError(f"timing {it.name or it.key} on {dev} failed: "
                               f"{type(e).__name__}: {e}") from e
        runs.append((jitted, args))
    samples: list[list[float]] = [[] for _ in items]
    active = list(range(len(items)))
    while active:
        lone = len(active) == 1 and len(items) > 1
        filler = min((i for i in range(len(items)) if i not in active),
                     key=lambda i: min(samples[i]), default=None) if lone else None
        for i in active:
            if filler is not None:
                jax.block_until_ready(runs[filler][0](*runs[filler][1]))
            jitted, args = runs[i]
            t0 = time.perf_counter()
            jax.block_until_ready(jitted(*args))
            samples[i].append(time.perf_counter() - t0)
        active = [i for i in active if len(samples[i]) < k and not (
            budget_s is not None and len(samples[i]) >= 3 and sum(samples[i]) >= budget_s)]
    return samples


def _nbytes(shapes) -> int:
    """Bytes of arrays of these shapes and dtypes (a typed PRNG key's too)."""
    import jax

    return sum(int(np.prod(x.shape)) * int(x.dtype.itemsize)
               for x in jax.tree_util.tree_leaves(tuple(shapes)) if hasattr(x, "dtype"))


def _groups(todo: Sequence[int], nbytes: Sequence[int]) -> list[list[int]]:
    """`todo` cut, in order, into runs of at most `INTERLEAVE_BYTES` of arguments."""
    groups, total = [], 0
    for i, b in zip(todo, nbytes, strict=True):
        if not groups or total + b > INTERLEAVE_BYTES:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += b
    return groups


def _enough(data: dict, k: int, budget_s: float | None) -> bool:
    """Whether a cached entry has what a caller asking for k runs needs."""
    runs = data["samples"]
    return (int(data.get("k", len(runs))) >= k or len(runs) >= k
            or (budget_s is not None and sum(runs) >= budget_s))


def cached_json(kind: str, digest: str, compute: Callable[[], dict],
                required: Sequence[str] = (),
                valid: Callable[[dict], bool] | None = None) -> dict:
    """`compute()`'s JSON object, remembered on disk under `cache_dir()/kind/digest.json`.

    An unreadable entry, or one missing a `required` key, is computed again
    (with a warning), and so is one `valid` refuses (silently: it is only
    short of what the caller asks now); entries are written atomically, so
    concurrent processes never read half a file.
    """
    data = _cache_read(kind, digest, required, valid)
    if data is None:
        data = compute()
        _cache_write(kind, digest, data)
    return data


def _cache_read(kind: str, digest: str, required: Sequence[str] = (),
                valid: Callable[[dict], bool] | None = None) -> dict | None:
    """The cached entry, or None (absent, unreadable, lacking `required`, or refused by `valid`)."""
    path = cache_dir() / kind / f"{digest}.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        missing = [k for k in required if k not in data]
        if missing:
            logging.warning("ignoring cache entry %s without %s", path, missing)
            return None
        return data if valid is None or valid(data) else None
    except (ValueError, TypeError, AttributeError) as e:  # unreadable, or not what we wrote
        logging.warning("ignoring unreadable cache entry %s: %s", path, e)
        return None


#: (kind, digest) of the entries this process wrote: read back later in the
#: same run (the rows after `measure_interleaved` timed every layer, or a
#: second device of the same kind) they were timed now, not `cached`.
_WRITTEN: set[tuple[str, str]] = set()


def _from_before(kind: str, digest: str) -> bool:
    """Whether a cache entry read now was there before this process timed anything."""
    return (kind, digest) not in _WRITTEN


def _cache_write(kind: str, digest: str, data: dict) -> None:
    """Writes an entry atomically (a reader never sees half a file)."""
    _WRITTEN.add((kind, digest))
    path = cache_dir() / kind / f"{digest}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def sweep_batch(
    make_fn_and_args: Callable[[int], tuple[Callable, Sequence[Any]]],
    batches: Sequence[int],
    device,
    *,
    k: int = 10,
    warmup: int = 2,
    key: str | None = None,
) -> list[tuple[int, Timing]]:
    """Measures one function family at several batch sizes.

    Args:
      make_fn_and_args: batch size -> `(fn, args)`.
      batches: the batch sizes, measured in this order.
      device: a JAX device or its name.
      k, warmup: as for `measure`.
      key: when given, results are cached under `f"{key}/batch={b}"`.

    Returns:
      `[(batch, Timing)]`; time per sample is `timing.median_s / batch`.
    """
    out = []
    for b in batches:
        fn, args = make_fn_and_args(int(b))
        if key is None:
            timing = measure(fn, args, device, k=k, warmup=warmup)
        else:
            timing = measure_cached(f"{key}/batch={b}", fn, args, device, k=k, warmup=warmup)
        logging.info("batch %d: %.3g s (%.3g s/sample)", b, timing.median_s, timing.median_s / b)
        out.append((int(b), timing))
    return out
