"""Device and link cost models: spec sheets, measured profiles, per-layer timing, prediction.

Imported as `hetpar.cost_models` (the folder is mapped into the package).
"""

from hetpar.cost_models._measure import (
    Timing,
    cache_dir,
    device_name,
    measure,
    measure_cached,
    present_devices,
    resolve_device,
    sweep_batch,
)
from hetpar.cost_models._microbench import (
    FULL,
    QUICK,
    BenchConfig,
    fit_link,
    profile_device,
    profile_devices,
    profile_link,
    spec_kind_of,
    summary_table,
    transfer_paths,
)
from hetpar.cost_models._profiles import (
    DTYPES,
    FORMAT,
    OP_CLASSES,
    VERSION,
    DeviceProfile,
    LinkProfile,
    ProfileSet,
    device_class,
    load_profiles,
    nearest_sibling,
    save_profiles,
)
from hetpar.cost_models._roofline import LayerWork, calibrate, predict, transfer_calibration
from hetpar.cost_models._specs import plan_prices, spec, spec_kinds

__all__ = [
    "DTYPES",
    "FORMAT",
    "FULL",
    "OP_CLASSES",
    "QUICK",
    "VERSION",
    "BenchConfig",
    "DeviceProfile",
    "LayerWork",
    "LinkProfile",
    "ProfileSet",
    "Timing",
    "cache_dir",
    "calibrate",
    "device_class",
    "device_name",
    "fit_link",
    "load_profiles",
    "measure",
    "measure_cached",
    "nearest_sibling",
    "plan_prices",
    "predict",
    "present_devices",
    "profile_device",
    "profile_devices",
    "profile_link",
    "resolve_device",
    "save_profiles",
    "spec",
    "spec_kind_of",
    "spec_kinds",
    "summary_table",
    "sweep_batch",
    "transfer_calibration",
    "transfer_paths",
]
