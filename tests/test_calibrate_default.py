"""`hetpar.auto` calibrates at its first call by default (issue 41, item 5).

The rest of the suite plans from spec sheets (conftest sets
HETPAR_CALIBRATE=0); these tests take that away and check the default:
the layers and the whole step are timed here, cached on disk for the next
process, the user sees progress, and a one-device plan runs the executable
its calibration compiled instead of compiling the step twice.
"""

import logging

import jax
import numpy as np
import pytest

import hetpar
from hetpar import cost_models, zoo
from tests.oracle import check_steps_equal_jit


@pytest.fixture
def calibrating(monkeypatch, tmp_path):
    """The default as a user meets it: no HETPAR_CALIBRATE, no profile file,
    a cache of its own; counts the whole steps timed."""
    monkeypatch.delenv("HETPAR_CALIBRATE", raising=False)
    monkeypatch.delenv("HETPAR_PROFILES", raising=False)
    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path / "cache"))
    timed = []
    real = cost_models.measure_step

    def counting(*args, **kwargs):
        timed.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(cost_models, "measure_step", counting)
    return timed


def test_the_default_calibrates_once_and_the_next_process_reads_the_cache(calibrating,
                                                                          capfd, caplog):
    w = zoo.get("mlp", small=True)
    args = w.example_args()
    step = hetpar.auto(w.train_step, devices=["cpu:0"])
    assert step.options.calibrates()
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        out = step(*args)
    # The calibration's jit is the run's: the whole step compiled once for both.
    compiles = [r for r in caplog.records if "Compiling jit(train_step)" in r.getMessage()]
    assert len(compiles) == 1, [r.getMessage()[:80] for r in compiles]
    compiled = step.lower(*args)
    assert compiled._jit is compiled._one_device_jits[compiled._device]
    assert compiled.table.meta["step_s"]["cpu:0"] > 0  # the whole step was timed
    assert len(calibrating) == 1
    err = capfd.readouterr().err
    assert "hetpar: calibrating on cpu:0 at the first call" in err
    assert "hetpar: calibrated in" in err
    check_steps_equal_jit(step, w.train_step, (*out[:-1], args[-1]), steps=2)

    # Another step object of the same program (as a later process): the
    # whole step's time comes from the disk cache, nothing is timed again.
    again = hetpar.auto(w.train_step, devices=["cpu:0"]).lower(*args)
    assert again.table.meta["step_s"] == compiled.table.meta["step_s"]
    assert len(calibrating) == 1


@pytest.mark.parametrize("how", ["spec", "env"])
def test_spec_sheets_when_asked(calibrating, monkeypatch, how):
    w = zoo.get("mlp", small=True)
    if how == "env":
        monkeypatch.setenv("HETPAR_CALIBRATE", "0")
    step = hetpar.auto(w.train_step, devices=["cpu:0"],
                       profile="spec" if how == "spec" else "auto")
    assert not step.options.calibrates()
    args = w.example_args()
    step(*args)
    compiled = step.lower(*args)
    assert compiled.predicted() is not None  # priced from spec sheets, on asking
    assert "step_s" not in compiled.table.meta
    assert calibrating == []


def test_a_donating_step_is_timed_apart_and_keeps_the_callers_state(calibrating):
    # A donating jit would delete the caller's arrays while timing: the
    # calibration times its own jit instead, and the run compiles its own.
    w = zoo.get("mlp", small=True)
    params, opt_state, batch = w.example_args()
    keep = jax.tree_util.tree_map(lambda x: x.copy(), (params, opt_state))
    step = hetpar.auto(w.train_step, devices=["cpu:0"], donate_argnums=(0, 1))
    compiled = step.lower(params, opt_state, batch)
    assert compiled.shared_jit(compiled._device) is None
    assert len(calibrating) == 1
    assert all(not x.is_deleted() for x in jax.tree_util.tree_leaves((params, opt_state)))
    for a, b in zip(jax.tree_util.tree_leaves(keep),
                    jax.tree_util.tree_leaves((params, opt_state))):
        np.testing.assert_array_equal(a, b)
