"""What a profile file measured over groups of devices at once prices a plan
made from it elsewhere: the ring of a group's collectives and the links to
pinned host memory with every accelerator streaming (`meta["collectives"]`,
`meta["place_links"]`; `hetpar profile` measures them,
`tests/test_cost_models.py::test_cli_profile_quick_end_to_end`)."""

import dataclasses

import pytest

import hetpar
from hetpar import zoo
from hetpar.cost_models import cost_table, load_profiles, save_profiles
from hetpar.planner import evaluate_sharded

RING = {"bandwidth_bytes_per_s": 263e9, "latency_s": 3e-5}  # two H200s' ring (fit_h200x2 run 30)
PLACES = {"bandwidth_bytes_per_s": 31e9, "at_once": 2,  # both streaming at once (run 35)
          "latency_s": 2e-5, "curve": [[1048576.0, 1e-4], [536870912.0, 1.7e-2]]}


@pytest.fixture(scope="module")
def graph():
    w = zoo.get("mlp", small=True)
    return hetpar.trace(w.train_step, *w.example_args())


def _place_links(table) -> dict:
    return {(k.src, k.dst): k.bandwidth_bytes_per_s for k in table.links
            if k.src.endswith(":pinned_host") != k.dst.endswith(":pinned_host")
            and k.src.split(":pinned_host")[0] == k.dst.split(":pinned_host")[0]}


def test_a_table_from_a_profile_takes_the_figures_measured_over_its_devices(graph, tmp_path):
    base = load_profiles()
    stored = {"collectives": {"h200:0+h200:1": RING,
                              "gpu:0+gpu:1": RING},  # devices the plan below does not use
              "place_links": {"h200:0+h200:1": PLACES}}
    path = tmp_path / "h200x2.json"
    save_profiles(path, dataclasses.replace(base, meta={**base.meta, **stored}))
    profiles = load_profiles(path)  # as a plan made elsewhere reads it

    table = cost_table(graph, ["cpu", "h200", "h200"], profiles=profiles)
    assert table.meta["collectives"] == {"h200:0+h200:1": RING}
    assert table.meta["place_links"] == {"h200:0+h200:1": PLACES}
    places = _place_links(table)
    assert len(places) == 4 and set(places.values()) == {31e9}
    assert {k.curve for k in table.links if (k.src, k.dst) in places} == {
        ((1048576.0, 1e-4), (536870912.0, 1.7e-2))}
    spec_only = cost_table(graph, ["cpu", "h200", "h200"])
    assert "collectives" not in spec_only.meta
    assert set(_place_links(spec_only).values()) != {31e9}
    # The links between the GPUs stay (the peer link); the planner prices
    # sharded state on the ring measured.
    links = {(k.src, k.dst): k for k in table.links}
    spec_links = {(k.src, k.dst): k for k in spec_only.links}
    assert links["h200:0", "h200:1"] == spec_links["h200:0", "h200:1"]
    ours, theirs = (evaluate_sharded(t, ["h200:0", "h200:1"], "fsdp")
                    for t in (table, spec_only))
    assert ours.transfer_s != pytest.approx(theirs.transfer_s)
    assert ours.busy_s == theirs.busy_s

    # Measured with two GPUs streaming at once, the place links are not one
    # GPU's: a plan for one keeps its own, and has no group to shard over.
    one = cost_table(graph, ["cpu", "h200"], profiles=profiles)
    assert "place_links" not in one.meta and "collectives" not in one.meta
    assert _place_links(one) == _place_links(cost_table(graph, ["cpu", "h200"]))


def test_a_profile_with_only_a_place_links_bandwidth_prices_as_before(graph, tmp_path):
    # Files written before the batch curve was measured: the links take the
    # bandwidth, keep their latency, and price a copy whole.
    base = load_profiles()
    old = {"bandwidth_bytes_per_s": 31e9, "at_once": 2}
    path = tmp_path / "old.json"
    save_profiles(path, dataclasses.replace(base, meta={**base.meta,
                                                        "place_links": {"h200:0+h200:1": old}}))
    table = cost_table(graph, ["cpu", "h200", "h200"], profiles=load_profiles(path))
    spec = {(k.src, k.dst): k for k in cost_table(graph, ["cpu", "h200", "h200"]).links}
    places = _place_links(table)
    assert len(places) == 4 and set(places.values()) == {31e9}
    for k in table.links:
        if (k.src, k.dst) in places:
            assert k.curve == () and k.latency_s == spec[k.src, k.dst].latency_s


@pytest.mark.parametrize("meta, says", [
    ({"collectives": {"h200:0+h200:1": {"bandwidth": 1e9}}}, "needs bandwidth_bytes_per_s"),
    ({"place_links": {"h200:0+h200:1": {"bandwidth_bytes_per_s": "fast"}}}, "got 'fast'"),
    ({"collectives": ["h200:0+h200:1"]}, "must map device groups"),
    ({"place_links": {"h200:0+h200:1": {"bandwidth_bytes_per_s": 3e10, "latency_s": -1}}},
     "needs latency_s"),
    ({"place_links": {"h200:0+h200:1": {"bandwidth_bytes_per_s": 3e10,
                                        "curve": [[64e6, 1e-3], [1e6, 1e-4]]}}},
     "bytes above 0 and rising"),
    ({"place_links": {"h200:0+h200:1": {"bandwidth_bytes_per_s": 3e10,
                                        "curve": [[0, 0.0], [1e6, 1e-4]]}}},
     "bytes above 0 and rising"),
    ({"place_links": {"h200:0+h200:1": {"bandwidth_bytes_per_s": 3e10, "latency_s": None}}},
     "needs latency_s"),
])
def test_a_malformed_stored_figure_is_refused_when_the_file_is_read(tmp_path, meta, says):
    from hetpar.core import ProfileError

    path = tmp_path / "edited.json"
    save_profiles(path, dataclasses.replace(load_profiles(), meta=meta))
    with pytest.raises(ProfileError, match=says) as e:
        load_profiles(path)
    assert "hetpar profile" in str(e.value)  # how to mend it
