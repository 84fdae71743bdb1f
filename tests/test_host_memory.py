"""Huge pages for the host CPU's layers: the CLI's re-exec and hetpar.auto's warning."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from hetpar.runtime import HostMemoryWarning, _host_memory
from hetpar.runtime._host_memory import (
    TUNABLE,
    ensure_huge_pages,
    has_huge_pages,
    warn_without_huge_pages,
    with_huge_pages,
)


@pytest.mark.parametrize("tunables, on", [
    (None, False), ("", False), ("glibc.malloc.hugetlb=0", False),
    ("glibc.malloc.hugetlb=1", True), ("glibc.malloc.hugetlb=2", True),
    ("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", True),
    ("glibc.malloc.arena_max=2", False)])
def test_huge_pages_are_read_from_glibc_tunables(tunables, on):
    env = {} if tunables is None else {"GLIBC_TUNABLES": tunables}
    assert has_huge_pages(env) is on


def test_the_tunable_joins_the_others():
    assert with_huge_pages({})["GLIBC_TUNABLES"] == TUNABLE
    both = with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"})
    assert both == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TUNABLE}", "PATH": "/bin"}
    off = with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})  # replaced, not doubled
    assert off["GLIBC_TUNABLES"] == TUNABLE
    kept = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=2"}
    assert with_huge_pages(kept) == kept


def _execs(argv, env, platform="linux"):
    calls = []
    ensure_huge_pages(argv, env, execve=lambda *a: calls.append(a), platform=platform)
    return calls


def test_the_cli_reexecutes_itself_with_huge_pages_for_commands_that_compute():
    (call,) = _execs(["run", "resnet18", "--steps", "3"], {"HOME": "/root"})
    path, argv, env = call
    assert path == sys.executable
    assert argv == [sys.executable, "-m", "hetpar", "run", "resnet18", "--steps", "3"]
    assert env == {"HOME": "/root", "GLIBC_TUNABLES": TUNABLE}
    assert _execs(["--verbosity", "1", "profile", "--quick"], {})  # flags before it
    for argv in (["plan", "g.json"], ["trace", "resnet18"], ["--help"], []):
        assert not _execs(argv, {}), argv
    assert not _execs(["run", "x"], {"GLIBC_TUNABLES": TUNABLE})  # set already: no loop
    assert not _execs(["run", "x"], {"HETPAR_NO_HUGE_PAGES": "1"})
    assert not _execs(["run", "x"], {}, platform="darwin")


def test_the_command_runs_with_huge_pages():
    """`python -m hetpar costs` really re-executes: its process sees the tunable."""
    code = ("import os, sys; from hetpar.runtime import _host_memory as h; "
            "sys.argv = ['hetpar', 'costs', '--help']; "
            "h.ensure_huge_pages(sys.argv[1:]); print(os.environ.get('GLIBC_TUNABLES'))")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("GLIBC_TUNABLES", "HETPAR_NO_HUGE_PAGES")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    if sys.platform == "linux":
        # Re-executed as `python -m hetpar costs --help`: the help, not the print.
        assert out.returncode == 0, out.stderr[-2000:]
        assert "costs" in out.stdout and TUNABLE not in out.stdout
    shown = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('GLIBC_TUNABLES'))"],
        env=with_huge_pages(env), capture_output=True, text=True, timeout=60).stdout
    assert TUNABLE in shown


@pytest.fixture
def fresh_warning(monkeypatch):
    monkeypatch.setattr(_host_memory, "_warned", False)


def test_auto_warns_once_when_a_cpu_computes_beside_an_accelerator(fresh_warning):
    with pytest.warns(HostMemoryWarning, match="GLIBC_TUNABLES=glibc.malloc.hugetlb=1"):
        assert warn_without_huge_pages(["cpu", "gpu"], env={}, platform="linux")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_without_huge_pages(["cpu", "gpu"], env={}, platform="linux")  # once


@pytest.mark.parametrize("platforms, env, platform", [
    (["cpu", "cpu"], {}, "linux"),  # the CPU alone: nothing waits on it
    (["gpu", "gpu"], {}, "linux"),
    (["cpu", "gpu"], {"GLIBC_TUNABLES": TUNABLE}, "linux"),
    (["cpu", "gpu"], {"HETPAR_NO_HUGE_PAGES": "1"}, "linux"),
    (["cpu", "tpu"], {}, "darwin")])
def test_no_warning_where_huge_pages_would_not_help(fresh_warning, platforms, env, platform):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_without_huge_pages(platforms, env=env, platform=platform)


def test_a_split_plan_on_cpus_alone_does_not_warn(fresh_warning, monkeypatch):
    """hetpar.auto asks about its plan's devices: CPUs alone (here two virtual ones)
    do not warn, the same plan with one of them taken for an accelerator does."""
    import jax
    import jax.numpy as jnp

    import hetpar

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("HETPAR_NO_HUGE_PAGES", raising=False)
    monkeypatch.setattr(sys, "platform", "linux")

    def step(w, x):
        def loss(w):
            with hetpar.layer("first"):
                h = jnp.tanh(x @ w[0])
            with hetpar.layer("second"):
                h = jnp.tanh(h @ w[1])
            return h.sum()

        val, g = jax.value_and_grad(loss)(w)
        return [a - 0.1 * b for a, b in zip(w, g)], val

    w, x = [jnp.ones((4, 4)), jnp.ones((4, 4)) * 0.5], jnp.ones((2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", HostMemoryWarning)
        hetpar.auto(step, plan={"first": "cpu:0", "second": "cpu:1"})(w, x)
    seen = []
    monkeypatch.setattr(_host_memory, "warn_without_huge_pages",
                        lambda platforms, **k: seen.append(sorted(platforms)))
    monkeypatch.setattr(hetpar._auto, "warn_without_huge_pages",
                        _host_memory.warn_without_huge_pages)
    hetpar.auto(step, plan={"first": "cpu:0", "second": "cpu:1"})(w, x)
    assert seen == [["cpu", "cpu"]]  # asked with the plan's devices' platforms
