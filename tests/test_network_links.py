"""Links between devices of different processes: the network link (issue 16).

Devices of several processes are named `p{process}/...`. Between two of
different processes a cost table has the network link of the two processes:
measured by `hetpar profile` under `jax.distributed`, declared with `--link
pA-pB=GBps[@LATENCY_us]` / `ProfileSet.with_network_link`, else the
documented default (12.5 GB/s, 20 us). Within a process, links are as before.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from hetpar.core import CostTable, Device, Edge, HetparError, Layer, Link, ProfileError
from hetpar.cost_models import (
    DEFAULT_NETWORK_BANDWIDTH,
    DEFAULT_NETWORK_LATENCY_S,
    NETWORK_PATH,
    LinkProfile,
    NetworkLink,
    ProfileSet,
    load_profiles,
    override_network_links,
    parse_network_link,
    process_of,
    resolve_devices,
    resolve_links,
    spec,
)

SIZES = (4096.0, 1e6)


def table_links(devices, profiles=None):
    profiles = profiles or load_profiles()
    devs = resolve_devices(devices, profiles)
    return {(lk.src, lk.dst): lk for lk in resolve_links(devs, profiles, SIZES)}, devs


def test_names_with_a_process():
    assert process_of("p1/cpu:0") == 1 and process_of("p12/h100:3") == 12
    assert process_of("p0/gpu:0:pinned_host") == 0
    assert process_of("cpu:0") is None and process_of("h100:0") is None


def test_default_network_link_between_processes():
    links, devs = table_links(["p0/cpu", "p0/cpu", "p1/cpu", "p1/cpu"])
    assert [d.name for d in devs] == ["p0/cpu:0", "p0/cpu:1", "p1/cpu:0", "p1/cpu:1"]
    assert len(links) == 12  # every ordered pair
    for (a, b), lk in links.items():
        if process_of(a) != process_of(b):
            assert lk.bandwidth_bytes_per_s == DEFAULT_NETWORK_BANDWIDTH == 12.5e9
            assert lk.latency_s == DEFAULT_NETWORK_LATENCY_S == 20e-6
        else:  # one host's CPU devices share its memory, as without processes
            cpu = spec("cpu")
            assert lk.bandwidth_bytes_per_s == cpu.memory_bandwidth_bytes_per_s / 2
            assert lk.latency_s == cpu.launch_overhead_s
    # Without a process in the names nothing changes (spec CPUs; cpu:0..3 are present).
    plain, devs = table_links(["cpu", "cpu"])
    a, b = (d.name for d in devs)
    assert plain[(a, b)].bandwidth_bytes_per_s == \
        links[("p0/cpu:0", "p0/cpu:1")].bandwidth_bytes_per_s


def test_accelerators_of_two_processes():
    links, devs = table_links(["p0/h100", "p0/cpu", "p1/h100", "h100"])
    assert [d.name for d in devs] == ["p0/h100:0", "p0/cpu:0", "p1/h100:0", "h100:0"]
    host = spec("h100").host_link
    # Within process 0: the spec sheet's host link, as for h100:0 -> cpu:0.
    assert links[("p0/h100:0", "p0/cpu:0")].bandwidth_bytes_per_s == host.bandwidth_bytes_per_s
    for pair in [("p0/h100:0", "p1/h100:0"), ("p1/h100:0", "p0/cpu:0")]:
        assert links[pair].bandwidth_bytes_per_s == DEFAULT_NETWORK_BANDWIDTH
    # A name without a process is on no process in particular: links as
    # within one machine (two H100s: their NVLink, the spec sheet's peer link).
    peer = spec("h100").peer_link
    assert links[("p0/h100:0", "h100:0")].latency_s == pytest.approx(peer.latency_s)
    assert links[("p0/h100:0", "h100:0")].bandwidth_bytes_per_s == peer.bandwidth_bytes_per_s


def test_two_absent_gpus_of_one_class_are_joined_by_their_peer_link():
    # Planning for a machine you do not have: two H200s talk over NVLink
    # (300 GB/s as JAX reached it), not through the host's PCIe twice
    # (~31 GB/s), so a model too large for one is planned as FSDP.
    links, _ = table_links(["cpu", "h200", "h200"])
    peer, host = spec("h200").peer_link, spec("h200").host_link
    assert links[("h200:0", "h200:1")].bandwidth_bytes_per_s == peer.bandwidth_bytes_per_s
    assert peer.bandwidth_bytes_per_s > 4 * host.bandwidth_bytes_per_s
    # Of different classes: through the host, two hops in series.
    links, _ = table_links(["a100", "h200"])
    assert links[("a100:0", "h200:0")].latency_s == pytest.approx(
        spec("a100").host_link.latency_s + host.latency_s)
    # The peer link survives a profile file's round trip.
    from cost_models import DeviceProfile

    again = DeviceProfile.from_json(spec("h200").to_json())
    assert again.peer_link == spec("h200").peer_link


def measured_profiles():
    """Profiles as `hetpar profile` writes them under 2 processes of one CPU device."""
    base = load_profiles()
    cpu = spec("cpu")
    devices = {n: cpu.replace(name=n, origin="measured") for n in ("p0/cpu:0", "p1/cpu:0")}
    measured = LinkProfile("p0", "p1", NETWORK_PATH, latency_s=3e-4, bandwidth_bytes_per_s=1e9,
                           source="measured (test)", samples=((4096.0, 3e-4), (1e6, 1.3e-3)))
    return ProfileSet({**base.devices, **devices}, (measured,))


def test_measured_network_link_applies_to_every_device_pair():
    profiles = measured_profiles()
    links, _ = table_links(["p0/cpu:0", "p1/cpu:0"], profiles)
    assert links[("p0/cpu:0", "p1/cpu:0")].bandwidth_bytes_per_s == 1e9
    assert links[("p0/cpu:0", "p1/cpu:0")].latency_s == 3e-4
    # Measured one way only: the other way takes it, and says so.
    assert links[("p1/cpu:0", "p0/cpu:0")].bandwidth_bytes_per_s == 1e9
    assert "p0 -> p1" in profiles.network_link(1, 0).source
    # Spec devices placed on those processes get it too.
    links, _ = table_links(["p0/cpu:0", "p1/h100"], profiles)
    assert links[("p1/h100:0", "p0/cpu:0")].bandwidth_bytes_per_s == 1e9


def test_with_network_link_overrides_the_measurement():
    profiles = measured_profiles().with_network_link(0, "p1", 5e9)
    for a, b in [(0, 1), (1, 0)]:
        lk = profiles.network_link(a, b)
        assert lk.bandwidth_bytes_per_s == 5e9 and lk.path == NETWORK_PATH
        assert lk.latency_s == 3e-4  # kept: none given
        assert lk.source.startswith("declared")
    assert len(profiles.links) == 2  # the measured entry is replaced
    links, _ = table_links(["p0/cpu:0", "p1/cpu:0"], profiles)
    assert links[("p1/cpu:0", "p0/cpu:0")].bandwidth_bytes_per_s == 5e9
    # With a latency, one way; a pair without a measurement keeps the default latency.
    one = load_profiles().with_network_link(2, 3, 1e9, 1e-3, both_ways=False)
    assert one.network_link(2, 3).latency_s == 1e-3
    assert one.network_link(3, 2).bandwidth_bytes_per_s == 1e9  # the other way's
    assert load_profiles().with_network_link(0, 1, 1e9).network_link(0, 1).latency_s == 20e-6
    with pytest.raises(ProfileError, match="two different processes"):
        load_profiles().with_network_link(1, 1, 1e9)
    with pytest.raises(ProfileError, match="bandwidth"):
        load_profiles().with_network_link(0, 1, 0.0)
    # `--link` texts work too (what hetpar.auto could pass through).
    texts = load_profiles().with_network_links(["p0-p1=2@50"])
    assert texts.network_link(1, 0).bandwidth_bytes_per_s == 2e9
    assert texts.network_link(1, 0).latency_s == pytest.approx(50e-6)


@pytest.mark.parametrize("text, want", [
    ("p0-p1=12.5", NetworkLink(0, 1, 12.5e9, None, "p0-p1=12.5")),
    ("p2-p10=0.5@20", NetworkLink(2, 10, 0.5e9, 20e-6, "p2-p10=0.5@20")),
    ("p1-p0=1e2@0", NetworkLink(1, 0, 100e9, 0.0, "p1-p0=1e2@0")),
    ("p0-p1=3@7.5us", NetworkLink(0, 1, 3e9, 7.5e-6, "p0-p1=3@7.5us")),
])
def test_parse_link(text, want):
    got = parse_network_link(text)
    assert got.a == want.a and got.b == want.b and got.text == want.text
    assert got.bandwidth_bytes_per_s == pytest.approx(want.bandwidth_bytes_per_s)
    assert got.latency_s == (None if want.latency_s is None else pytest.approx(want.latency_s))


@pytest.mark.parametrize("bad, why", [
    ("p0-p1", "expects pA-pB=GBps"), ("0-1=5", "expects"), ("p0=5", "expects"),
    ("p0-p1=", "expects"), ("p0-p1=fast", "positive number of GB/s"),
    ("p0-p1=-2", "positive number"), ("p0-p1=0", "positive number"),
    ("p0-p1=inf", "positive number"), ("p0-p1=5@", "expects"),
    ("p0-p1=5@-1", "microseconds >= 0"), ("p0-p1=5@x", "microseconds"),
    ("p1-p1=5", "two different processes"), ("cpu:0-cpu:1=5", "expects"),
])
def test_parse_link_rejects(bad, why):
    with pytest.raises(ProfileError, match=why) as e:
        parse_network_link(bad)
    assert "p0-p1=12.5" in str(e.value)  # the message shows the form


def two_process_table() -> CostTable:
    names = ["p0/cpu:0", "p0/cpu:1", "p1/cpu:0"]
    devices = [Device(n, "cpu", memory_bytes=1e10) for n in names]
    links = [Link(a, b, bandwidth_bytes_per_s=1e10, latency_s=1e-5)
             for a in names for b in names if a != b]
    layers = [Layer(f"l{i}", time_s={n: 1e-3 for n in names}, memory_bytes={n: 1e6 for n in names})
              for i in range(3)]
    edges = [Edge("l0", "l1", 1e6), Edge("l1", "l2", 1e6)]
    return CostTable(devices=devices, links=links, layers=layers, edges=edges)


def test_override_network_links_of_a_table():
    table = override_network_links(two_process_table(), ["p0-p1=2@100"])
    for (a, b) in [("p0/cpu:0", "p1/cpu:0"), ("p1/cpu:0", "p0/cpu:1")]:
        lk = table.link(a, b)
        assert lk.bandwidth_bytes_per_s == 2e9 and lk.latency_s == pytest.approx(1e-4)
    assert table.link("p0/cpu:0", "p0/cpu:1").bandwidth_bytes_per_s == 1e10  # same process
    assert table.meta["network_links"] == ["declared (--link p0-p1=2@100): 2 GB/s, 100 us per "
                                           "transfer"]
    kept = override_network_links(two_process_table(), [NetworkLink(1, 0, 3e9)])
    assert kept.link("p1/cpu:0", "p0/cpu:0").latency_s == 1e-5  # no latency: kept
    with pytest.raises(ProfileError, match="no device of process 2"):
        override_network_links(two_process_table(), ["p0-p2=1"])


def test_cli_plan_link_changes_the_table(tmp_path, monkeypatch):
    import hetpar.planner
    from hetpar.cli import _parser

    graph = tmp_path / "graph.json"
    two_process_table().save(graph)
    seen = []

    def fake_plan(table, **kw):
        seen.append(table)
        raise HetparError("stop here")

    monkeypatch.setattr(hetpar.planner, "plan", fake_plan)
    args = _parser().parse_args(["plan", "--graph", str(graph), "--link", "p0-p1=4@30",
                                 "--link", "p1-p0=5"])
    with pytest.raises(HetparError, match="stop here"):
        args.func(args)
    lk = seen[0].link("p0/cpu:1", "p1/cpu:0")
    assert lk.bandwidth_bytes_per_s == 5e9 and lk.latency_s == pytest.approx(30e-6)  # later wins
    # A malformed value fails before any work, with the form in the message.
    args = _parser().parse_args(["plan", "--graph", str(graph), "--link", "p0-p1:4"])
    with pytest.raises(HetparError, match=r"expects pA-pB=GBps or pA-pB=GBps@LATENCY_us"):
        args.func(args)
    assert len(seen) == 1


def test_cli_plan_link_error_exit_status(tmp_path):
    graph = tmp_path / "graph.json"
    two_process_table().save(graph)
    proc = subprocess.run([sys.executable, "-m", "hetpar", "plan", "--graph", str(graph),
                           "--link", "p0-p1=fast"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "hetpar plan: error: --link 'p0-p1=fast': the bandwidth must be a positive number " \
           "of GB/s (expected pA-pB=GBps or pA-pB=GBps@LATENCY_us" in proc.stderr


@pytest.mark.slow  # two processes profiling: ~12 s; the link model is tested fast above
def test_hetpar_profile_measures_the_network_across_two_processes(tmp_path):
    out = tmp_path / "profiles.json"
    hetpar = os.path.join(os.path.dirname(sys.executable), "hetpar")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "hetpar.launch", "-n", "2", "--devices_per_process", "2",
         hetpar, "profile", "--quick", "--out", str(out), "--link", "p0-p2=1"],
        capture_output=True, text=True, env=env, timeout=240)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"[p1] process 1: done; process 0 writes {out}" in proc.stdout
    data = json.loads(out.read_text())
    assert [d["name"] for d in data["devices"]] == ["p0/cpu:0", "p0/cpu:1", "p1/cpu:0",
                                                    "p1/cpu:1"]
    assert data["meta"]["processes"] == 2 and set(data["meta"]["hosts"]) == {"p0", "p1"}
    net = {(lk["src"], lk["dst"]): lk for lk in data["links"] if lk["path"] == NETWORK_PATH}
    assert set(net) == {("p0", "p1"), ("p1", "p0"), ("p0", "p2"), ("p2", "p0")}
    for pair in [("p0", "p1"), ("p1", "p0")]:
        lk = net[pair]
        assert lk["bandwidth_bytes_per_s"] > 0 and len(lk["samples"]) == 4
        src, dst = pair
        assert f"ppermute from {src}/cpu:0 to {dst}/cpu:0" in lk["source"]
    assert net[("p0", "p2")]["bandwidth_bytes_per_s"] == 1e9  # declared with --link
    local = {(lk["src"], lk["dst"]) for lk in data["links"] if lk["path"] == "device_put"}
    assert local == {("p0/cpu:0", "p0/cpu:1"), ("p0/cpu:1", "p0/cpu:0"),
                     ("p1/cpu:0", "p1/cpu:1"), ("p1/cpu:1", "p1/cpu:0")}
    # Planning from that file in one process: the measured link between the processes.
    profiles = load_profiles(out)
    links, _ = table_links(["p0/cpu:1", "p1/cpu:0"], profiles)
    got = links[("p0/cpu:1", "p1/cpu:0")]
    assert got.bandwidth_bytes_per_s == net[("p0", "p1")]["bandwidth_bytes_per_s"]
    assert seconds < 120, seconds
