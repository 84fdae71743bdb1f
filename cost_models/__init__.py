"""Device and link cost models: spec sheets, measured profiles, per-layer timing, prediction.

Imported as `hetpar.cost_models` (the folder is mapped into the package).
Importing it loads neither JAX nor SciPy; they load when something is
measured, traced or fitted. One idea per module, lower ones first:

- `_devices`: the JAX devices present, their names (`cpu:0`) and spec kinds.
- `_profile`: one device's and one link's figures (`DeviceProfile`,
  `LinkProfile`), the op classes and dtypes they are keyed by.
- `_specs`: the built-in spec sheets, and what a plan pays for each device.
- `_profiles`: sets of profiles (`ProfileSet`), the profile file, and the
  calibration a spec kind borrows from its measured sibling.
- `_roofline`: a layer's work (`LayerWork`), its predicted time, and the
  calibration of a profile's efficiencies on measurements.
- `_measure`: timing a function on a device (or replicas), cached on disk.
- `_bench_config`: the sizes and repetitions of a benchmark run (`BenchConfig`).
- `_link_bench`: the transfer paths between devices, and the network between
  processes, timed by size and fitted (`profile_link`, `profile_network`).
- `_microbench`: the device benchmarks, and the whole run `hetpar profile`
  makes (`profile_devices`).
- `_layer_work`: the roofline's view of a traced layer.
- `_layer_timing`: timing a traced layer alone, on random inputs.
- `_resolve`: a device list's graph.json devices and the links between them.
- `_group_figures`: what devices ran together (a group's collectives, the
  links to pinned host memory with all copying at once) set on a table.
- `_layer_fit`: a present device's efficiencies fitted on measured layers.
- `_table`: the planner's CostTable of a traced step (graph.json).
- `_calibrate_table`: a CostTable scaled to whole steps timed on the devices
  present, with the runtime's costs the scaling took out measured back.
- `_report`: a table's figures per sample (seconds, dollars, joules).
"""

from hetpar.cost_models._bench_config import FULL, QUICK, BenchConfig
from hetpar.cost_models._calibrate_table import scale_to_step, scale_to_timed_step
from hetpar.cost_models._devices import (
    device_name,
    global_device_name,
    has_pinned_host,
    host_cores,
    live_capacity,
    local_name,
    present_devices,
    process_of,
    resolve_device,
    runtime_path,
    spec_kind_of,
)
from hetpar.cost_models._equation_model import (
    MatmulEquation,
    fit_equation_model,
    matmul_equations,
    predict_layer,
)
from hetpar.cost_models._layer_fit import (
    fit_on_layers,
    fit_samples,
    layer_samples,
    with_layer_model,
)
from hetpar.cost_models._layer_timing import (
    LAYER_RUNS,
    measure_layer,
    measure_layers,
    measure_update,
    random_inputs,
)
from hetpar.cost_models._layer_work import (
    count_kernels,
    graph_layer_work,
    layer_fused_bytes,
    layer_io,
    layer_kernels,
    layer_work,
    layer_xla_cost,
)
from hetpar.cost_models._link_bench import fit_link, profile_link, profile_network, transfer_paths
from hetpar.cost_models._measure import (
    Timing,
    batch_share,
    cache_dir,
    cache_key,
    cached_json,
    measure,
    measure_cached,
    measure_step,
    sweep_batch,
)
from hetpar.cost_models._microbench import profile_device, profile_devices, summary_table
from hetpar.cost_models._profile import (
    DEFAULT_NETWORK_BANDWIDTH,
    DEFAULT_NETWORK_LATENCY_S,
    DTYPES,
    FORMAT,
    NETWORK_PATH,
    OP_CLASSES,
    ROOFLINE_CLASS,
    VERSION,
    DeviceProfile,
    LinkProfile,
    default_network_link,
    device_class,
)
from hetpar.cost_models._profiles import (
    NetworkLink,
    ProfileSet,
    load_profiles,
    nearest_sibling,
    parse_network_link,
    save_profiles,
    transfer_calibration,
)
from hetpar.cost_models._report import per_sample
from hetpar.cost_models._resolve import (
    ResolvedDevice,
    override_network_links,
    resolve_devices,
    resolve_links,
)
from hetpar.cost_models._roofline import LayerWork, calibrate, predict
from hetpar.cost_models._specs import plan_prices, spec, spec_kinds
from hetpar.cost_models._table import (
    FUSED_BYTES_CLASSES,
    TimingBudget,
    cost_table,
)

__all__ = [
    "DEFAULT_NETWORK_BANDWIDTH",
    "DEFAULT_NETWORK_LATENCY_S",
    "DTYPES",
    "FORMAT",
    "FULL",
    "FUSED_BYTES_CLASSES",
    "NETWORK_PATH",
    "OP_CLASSES",
    "QUICK",
    "ROOFLINE_CLASS",
    "VERSION",
    "BenchConfig",
    "DeviceProfile",
    "LayerWork",
    "LinkProfile",
    "NetworkLink",
    "ProfileSet",
    "ResolvedDevice",
    "Timing",
    "TimingBudget",
    "cache_dir",
    "calibrate",
    "cost_table",
    "count_kernels",
    "default_network_link",
    "device_class",
    "device_name",
    "fit_link",
    "global_device_name",
    "graph_layer_work",
    "has_pinned_host",
    "layer_fused_bytes",
    "layer_io",
    "layer_kernels",
    "layer_work",
    "layer_xla_cost",
    "load_profiles",
    "local_name",
    "batch_share",
    "measure",
    "measure_step",
    "MatmulEquation",
    "fit_equation_model",
    "matmul_equations",
    "predict_layer",
    "with_layer_model",
    "fit_on_layers",
    "fit_samples",
    "layer_samples",
    "measure_cached",
    "cache_key",
    "cached_json",
    "measure_layer",
    "measure_layers",
    "measure_update",
    "nearest_sibling",
    "override_network_links",
    "parse_network_link",
    "per_sample",
    "plan_prices",
    "predict",
    "host_cores",
    "live_capacity",
    "present_devices",
    "process_of",
    "profile_device",
    "profile_devices",
    "profile_link",
    "profile_network",
    "random_inputs",
    "LAYER_RUNS",
    "resolve_device",
    "resolve_devices",
    "resolve_links",
    "runtime_path",
    "save_profiles",
    "scale_to_step",
    "scale_to_timed_step",
    "spec",
    "spec_kind_of",
    "spec_kinds",
    "summary_table",
    "sweep_batch",
    "transfer_calibration",
    "transfer_paths",
]
