"""Huge pages for the host CPU's layers: the CLI's re-exec and hetpar.auto's warning."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

import hetpar
from hetpar import _host_memory
from hetpar._host_memory import (
    TUNABLE,
    ensure_huge_pages,
    glibc_takes_it,
    has_huge_pages,
    hugetlb_setting,
    warn_without_huge_pages,
    with_huge_pages,
)

GLIBC = "glibc 2.39"


@pytest.mark.parametrize("tunables, setting, on", [
    (None, None, False), ("", None, False), ("glibc.malloc.hugetlb=0", "0", False),
    ("glibc.malloc.hugetlb=1", "1", True), ("glibc.malloc.hugetlb=2", "2", True),
    ("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "1", True),
    ("glibc.malloc.arena_max=2", None, False)])
def test_huge_pages_are_read_from_glibc_tunables(tunables, setting, on):
    env = {} if tunables is None else {"GLIBC_TUNABLES": tunables}
    assert hugetlb_setting(env) == setting
    assert has_huge_pages(env) is on


def test_the_tunable_joins_the_others_and_a_users_value_stays():
    assert with_huge_pages({})["GLIBC_TUNABLES"] == TUNABLE
    both = with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"})
    assert both == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TUNABLE}", "PATH": "/bin"}
    for named in ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=2"):
        assert with_huge_pages({"GLIBC_TUNABLES": named}) == {"GLIBC_TUNABLES": named}


@pytest.mark.parametrize("libc, takes", [
    ("glibc 2.39", True), ("glibc 2.35", True), ("glibc 2.34", False),
    ("glibc 3.0", True), ("musl 1.2", False), ("", False), ("glibc x", False)])
def test_only_a_glibc_that_has_the_tunable_gets_it(libc, takes):
    assert glibc_takes_it(libc) is takes


def _execs(argv, env, platform="linux", libc=GLIBC, orig=None):
    calls = []
    ensure_huge_pages(argv, env, execve=lambda *a: calls.append(a), platform=platform, libc=libc,
                      orig_argv=orig or [sys.executable, "-m", "hetpar", *argv])
    return calls


def test_the_cli_reexecutes_itself_as_started_for_commands_that_compute():
    (call,) = _execs(["run", "resnet18", "--steps", "3"], {"HOME": "/root"},
                     orig=["python3", "-X", "importtime", "-m", "hetpar", "run", "resnet18",
                           "--steps", "3"])
    path, argv, env = call
    assert path == sys.executable  # interpreter options and -m kept
    assert argv == [sys.executable, "-X", "importtime", "-m", "hetpar", "run", "resnet18",
                    "--steps", "3"]
    assert env == {"HOME": "/root", "GLIBC_TUNABLES": TUNABLE}
    script = ["python3", "/venv/bin/hetpar", "profile", "--quick"]  # the console script
    assert _execs(["profile", "--quick"], {}, orig=script)[0][1] == [sys.executable, *script[1:]]
    assert _execs(["--verbosity", "1", "costs", "x"], {})  # a flag's value first
    for argv in (["plan", "g.json"], ["trace", "resnet18"], ["--help"], []):
        assert not _execs(argv, {}), argv
    assert not _execs(["run", "x"], {"GLIBC_TUNABLES": TUNABLE})  # set already: no loop
    assert not _execs(["run", "x"], {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})  # the user's
    assert not _execs(["run", "x"], {"HETPAR_NO_HUGE_PAGES": ""})
    assert not _execs(["run", "x"], {}, platform="darwin")
    assert not _execs(["run", "x"], {}, libc="glibc 2.31")


def test_the_cli_entry_point_reexecutes_from_the_shell_only(monkeypatch):
    """`hetpar.cli.run()` (the console script, `python -m hetpar`) re-executes;
    `run(argv)`, called from Python, keeps the caller's process."""
    from hetpar import cli

    class Exec(Exception):
        pass

    def execve(path, argv, env):
        raise Exec(argv, env)

    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(_host_memory, "glibc_takes_it", lambda libc=None: True)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("HETPAR_NO_HUGE_PAGES", raising=False)
    monkeypatch.setattr(sys, "argv", ["hetpar", "costs", "--help"])
    with pytest.raises(Exec) as e:
        cli.run()
    assert e.value.args[1]["GLIBC_TUNABLES"] == TUNABLE
    with pytest.raises(SystemExit) as done:  # the help, in this process
        cli.run(["costs", "--help"])
    assert done.value.code == 0


@pytest.mark.skipif(sys.platform != "linux" or not glibc_takes_it(),
                    reason="the tunable is for glibc 2.35+ on Linux")
def test_the_command_runs_once_more_with_huge_pages(tmp_path):
    """`python -m hetpar costs --help` starts two interpreters: the first without
    the tunable, the second (its re-exec) with it; `plan` starts one."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nprint('started', os.environ.get('GLIBC_TUNABLES'), flush=True)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", "HETPAR_NO_HUGE_PAGES")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    starts = {}
    for command in ("costs", "plan"):
        out = subprocess.run([sys.executable, "-m", "hetpar", command, "--help"], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        starts[command] = [line for line in out.stdout.splitlines() if line.startswith("started")]
    assert starts["costs"] == ["started None", f"started {TUNABLE}"]
    assert starts["plan"] == ["started None"]


@pytest.fixture
def fresh_warning(monkeypatch):
    monkeypatch.setattr(_host_memory, "_warned", False)


def test_auto_warns_once_when_a_cpu_computes_beside_an_accelerator(fresh_warning):
    with pytest.warns(HostMemoryWarning, match="GLIBC_TUNABLES=glibc.malloc.hugetlb=1") as w:
        assert warn_without_huge_pages(["cpu", "gpu"], {}, platform="linux", libc=GLIBC)
    assert w[0].filename == __file__  # it points at the caller, not at hetpar
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_without_huge_pages(["cpu", "gpu"], {}, platform="linux", libc=GLIBC)


HostMemoryWarning = hetpar.HostMemoryWarning


@pytest.mark.parametrize("platforms, env, platform, libc", [
    (["cpu", "cpu"], {}, "linux", GLIBC),  # the CPU alone: nothing waits on it
    (["gpu", "gpu"], {}, "linux", GLIBC),
    (["cpu", "gpu"], {"GLIBC_TUNABLES": TUNABLE}, "linux", GLIBC),
    (["cpu", "gpu"], {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "linux", GLIBC),
    (["cpu", "gpu"], {"HETPAR_NO_HUGE_PAGES": "1"}, "linux", GLIBC),
    (["cpu", "gpu"], {}, "linux", "glibc 2.31"),
    (["cpu", "tpu"], {}, "darwin", GLIBC)])
def test_no_warning_where_huge_pages_would_not_help(fresh_warning, platforms, env, platform,
                                                    libc):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_without_huge_pages(platforms, env, platform=platform, libc=libc)


def test_auto_asks_with_the_platforms_that_compute(fresh_warning, monkeypatch):
    """hetpar.auto asks with the platforms of the devices that run stages: two
    virtual CPUs computing say ["cpu", "cpu"] (no warning); a CPU that only
    holds a layer's state is not asked about."""
    import jax
    import jax.numpy as jnp

    def step(w, x):
        def loss(w):
            with hetpar.layer("first"):
                h = jnp.tanh(x @ w[0])
            with hetpar.layer("second"):
                h = jnp.tanh(h @ w[1])
            return h.sum()

        val, g = jax.value_and_grad(loss)(w)
        return [a - 0.1 * b for a, b in zip(w, g)], val

    seen = []
    monkeypatch.setattr("hetpar._compiled_step.warn_without_huge_pages",
                        lambda platforms: seen.append(sorted(platforms)))
    w, x = [jnp.ones((4, 4)), jnp.ones((4, 4)) * 0.5], jnp.ones((2, 4))
    hetpar.auto(step, plan={"first": "cpu:0", "second": "cpu:1"})(w, x)
    held = {"compute": "cpu:0", "state": "cpu:1", "update": "cpu:0"}
    hetpar.auto(step, plan={"first": "cpu:0", "second": held})(w, x)
    assert seen == [["cpu", "cpu"], ["cpu"]]


def test_kept_freed_memory_is_opt_in_and_joins_huge_pages():
    from hetpar._host_memory import KEEP_OPT_IN, KEEP_TUNABLES, malloc_env

    assert malloc_env({}, "linux", GLIBC) == {"GLIBC_TUNABLES": TUNABLE}
    kept = malloc_env({KEEP_OPT_IN: "1"}, "linux", GLIBC)["GLIBC_TUNABLES"].split(":")
    assert kept == [TUNABLE, *KEEP_TUNABLES]
    # The user's own values stay, huge pages' opt-out included.
    mine = malloc_env({KEEP_OPT_IN: "", "HETPAR_NO_HUGE_PAGES": "1",
                       "GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, "linux", GLIBC)
    assert mine["GLIBC_TUNABLES"].split(":") == ["glibc.malloc.arena_max=4", *KEEP_TUNABLES[1:]]
    assert malloc_env({KEEP_OPT_IN: "1"}, "darwin", GLIBC) == {KEEP_OPT_IN: "1"}


def test_the_cli_reexecutes_to_keep_freed_memory_where_asked():
    from hetpar._host_memory import KEEP_OPT_IN, KEEP_TUNABLES

    (call,) = _execs(["run", "x"], {KEEP_OPT_IN: "1", "GLIBC_TUNABLES": TUNABLE})
    assert call[2]["GLIBC_TUNABLES"] == ":".join([TUNABLE, *KEEP_TUNABLES])
    assert not _execs(["run", "x"], {KEEP_OPT_IN: "1", "GLIBC_TUNABLES": call[2][
        "GLIBC_TUNABLES"]})  # all there: no loop
    assert not _execs(["plan", "x"], {KEEP_OPT_IN: "1"})


_UPDATE_FAULTS = """
import resource, threading
import jax, jax.numpy as jnp, optax
params = {f"w{i}": jnp.full((16 * 2**20,), 0.5, jnp.float32) for i in range(4)}  # 4 x 64 MB
grads = jax.tree.map(lambda p: p * 1e-3, params)
opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
def update(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s
f = jax.jit(update, donate_argnums=(0, 1))
state = [params, opt.init(params)]
faults = []
def calls():  # from a thread of its own, as the runtime's CPU worker calls a stage
    for _ in range(6):
        r = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        state[:] = jax.block_until_ready(f(*state, grads))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r)
t = threading.Thread(target=calls); t.start(); t.join()
print(min(faults[2:]))
"""


@pytest.mark.skipif(sys.platform != "linux" or not glibc_takes_it(),
                    reason="glibc's tunables on Linux")
def test_kept_freed_memory_spares_a_cpu_update_its_page_faults():
    """The real thing, in processes of their own: a donated clipped AdamW over
    256 MB called from a worker thread faults its temporaries in afresh on
    every call under glibc's defaults, and (almost) never with
    `KEEP_TUNABLES` set at start."""
    from hetpar._host_memory import KEEP_TUNABLES

    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["JAX_PLATFORMS"] = "cpu"
    faults = {}
    for mode, tunables in (("default", None), ("kept", ":".join(KEEP_TUNABLES))):
        run_env = dict(env, **({"GLIBC_TUNABLES": tunables} if tunables else {}))
        out = subprocess.run([sys.executable, "-c", _UPDATE_FAULTS], env=run_env,
                             capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-2000:]
        faults[mode] = int(out.stdout.split()[-1])
    assert faults["default"] > 10_000, faults  # 40 MB or more of fresh pages a call
    assert faults["kept"] < faults["default"] / 10, faults


def test_the_pinned_pool_may_grow_to_most_of_the_hosts_ram(monkeypatch):
    """XLA's pinned host pool (64 GiB unless XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB
    says otherwise) held back a 6.74B model's fetched state on a 125 GiB
    host: `import hetpar` lets it grow to three quarters of the RAM (the
    rest for the process and the arrays on its CPU devices: grown to the
    whole RAM, the pool's last region ran the host out, run 56), where the
    user set nothing and JAX's clients have not started (it is read then)."""
    from hetpar import _host_memory

    monkeypatch.setattr(_host_memory.os, "sysconf",
                        lambda name: 4096 if name == "SC_PAGE_SIZE" else (125 << 30) // 4096)
    monkeypatch.setattr(_host_memory, "_backends_started", lambda: False)
    var = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
    env: dict = {}
    assert _host_memory.widen_pinned_pool(env) and env == {var: "93"}
    small: dict = {}  # three quarters of 80 GiB is under the default: left alone
    assert not _host_memory.widen_pinned_pool(small, ram=80 << 30) and small == {}
    mine = {var: "32"}  # the user's stands
    assert not _host_memory.widen_pinned_pool(mine) and mine[var] == "32"
    monkeypatch.setattr(_host_memory, "_backends_started", lambda: True)  # too late: read already
    late: dict = {}
    assert not _host_memory.widen_pinned_pool(late) and late == {}


def test_the_pinned_pool_holds_its_regions_of_the_hosts_ram():
    """The pool grows by doubling regions from 2 MiB, the last cut at its
    limit: serving 77 GB under a 125 GiB limit it held 64 GiB and asked the
    OS for 60.7 GiB more (run 56's log: "could not allocate pinned host of
    size: 65194164224")."""
    from hetpar.core import pinned_pool_reserved

    GiB, MiB = float(1 << 30), float(1 << 20)
    assert pinned_pool_reserved(0, 125 * GiB) == 0 == pinned_pool_reserved(-1.0, 1.0)
    assert pinned_pool_reserved(1, 125 * GiB) == 2 * MiB
    assert pinned_pool_reserved(3 * MiB, 125 * GiB) == 6 * MiB  # 2 + 4
    full = 2 * MiB * (2 ** 15 - 1)  # 15 regions: just under 64 GiB
    assert pinned_pool_reserved(full, 125 * GiB) == full
    limit = 65194164224 + full  # run 56: the next region was what the limit left
    assert pinned_pool_reserved(77.1e9, limit) == limit
    assert pinned_pool_reserved(77.1e9, 93 * GiB) == 93 * GiB
    for served in (5e6, 3e9, 40e9, 70e9):  # never more than twice what it serves
        assert served <= pinned_pool_reserved(served, 1e15) < 2 * served + 2 * MiB


def test_jax_backends_started_is_read_from_jax():
    import jax

    from hetpar._host_memory import _backends_started

    jax.devices()
    assert _backends_started()
