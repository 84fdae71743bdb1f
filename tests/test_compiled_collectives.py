"""What a compiled whole step moves between devices (`step["collectives"]` in
the report), read from its HLO and priced at the group's ring."""

import jax
import pytest

import hetpar
from hetpar import zoo
from hetpar._compiled_collectives import hlo_collectives, in_loops, ring_seconds, ring_share

TWO = ["cpu:0", "cpu:1"]

HLO = """
  %all-gather.29 = f32[64,64]{1,0} all-gather(%param.7), channel_id=76, dimensions={0}
  %ags = (f32[32,64]{1,0}, f32[64,64]{1,0}) all-gather-start(%p), channel_id=3
  %agd = f32[64,64]{1,0} all-gather-done(%ags)
  %rs = bf16[32,64]{1,0} reduce-scatter(%x), dimensions={0}, to_apply=%add
  %ar = f32[128,64]{1,0} all-reduce(%y), to_apply=%add
  %ars = f32[128,64]{1,0} all-reduce-start(%y), to_apply=%add
  %ard = f32[128,64]{1,0} all-reduce-done(%ars)
  %a2a = (f32[32,1,32]{2,1,0}, f32[32,1,32]{2,1,0}) all-to-all(%a, %b), dimensions={1}
  %fusion = f32[64,64]{1,0} fusion(%all-gather.29), kind=kLoop, calls=%fused_computation
"""


def test_collectives_are_read_from_their_results_by_the_op():
    got = hlo_collectives(HLO, 2)
    # An all-gather's result is the whole (64 x 64 f32): each member receives half
    # of it; the started one's result is its tuple's second half.
    assert got["all-gather"] == {"count": 2, "ring_bytes": 2 * 64 * 64 * 4 / 2}
    # A reduce-scatter's result is one member's share (bf16): it sends one share.
    assert got["reduce-scatter"] == {"count": 1, "ring_bytes": 32 * 64 * 2}
    # An all-reduce is a reduce-scatter and an all-gather of the whole; the
    # -done half of an async pair is not counted again.
    assert got["all-reduce"] == {"count": 2, "ring_bytes": 2 * (2 * 128 * 64 * 4 / 2)}
    assert got["all-to-all"] == {"count": 1, "ring_bytes": 2 * 32 * 32 * 4 / 2}
    assert "collective-permute" not in got


ASYNC = """
  %rss = ((f32[64,64]{1,0}), f32[32,64]{1,0}) reduce-scatter-start(%x), dimensions={0}
  %rsd = f32[32,64]{1,0} reduce-scatter-done(%rss)
  %cps = ((f32[4], f32[8]), (f32[4], f32[8]), u32[], u32[]) collective-permute-start(%a, %b)
  %a2a = ((s4[64]{0}), f8e4m3fn[64]{0}) all-to-all-start(%q)
  %tok = pred[16]{0} all-reduce(%m), to_apply=%or
"""


def test_an_async_start_is_read_by_its_result_whatever_the_nesting():
    """XLA prints an async start as (operands, result, contexts...): the result
    is its second element, a tuple itself for a combined op. Element widths
    come from the type (s4 half a byte, f8 one, pred one)."""
    got = hlo_collectives(ASYNC, 2)
    assert got["reduce-scatter"] == {"count": 1, "ring_bytes": 32 * 64 * 4}
    assert got["collective-permute"] == {"count": 1, "ring_bytes": (4 + 8) * 4}
    assert got["all-to-all"] == {"count": 1, "ring_bytes": 64 * 1 / 2}
    assert got["all-reduce"] == {"count": 1, "ring_bytes": 16}


def test_a_while_loop_is_seen():
    assert not in_loops(HLO)
    assert in_loops(HLO + "  %w = (s32[], f32[8]{0}) while(%t), condition=%c, body=%b\n")


def test_the_ring_share_grows_with_the_group():
    assert ring_share("all-gather", 4) == 0.75 and ring_share("reduce-scatter", 4) == 3.0
    assert ring_share("all-reduce", 4) == 1.5
    assert hlo_collectives(HLO, 4)["all-gather"]["ring_bytes"] == 2 * 64 * 64 * 4 * 0.75


def test_ring_seconds_are_the_bytes_over_the_bandwidth_and_a_latency_per_all_reduce():
    got = {"all-gather": {"count": 2, "ring_bytes": 1e9}, "all-reduce": {"count": 3,
                                                                          "ring_bytes": 5e8}}
    assert ring_seconds(got, 1e11) == pytest.approx(1.5e9 / 1e11)
    # each all-reduce: a ring of 2 (n - 1) steps, each paying the latency
    assert ring_seconds(got, 1e11, 1e-4) == pytest.approx(1.5e9 / 1e11 + 3 * 2 * 1e-4)
    assert ring_seconds(got, 1e11, 1e-4, n=4) == pytest.approx(1.5e9 / 1e11 + 3 * 6 * 1e-4)
    del got["all-reduce"]
    assert ring_seconds(got, 1e11, 1e-4) == pytest.approx(1e9 / 1e11)


def _param_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("data_parallel", ["always", "fsdp"])
def test_the_report_sets_the_compiled_collectives_beside_the_planned(data_parallel):
    """Real compiles over two virtual CPUs: data parallel all-reduces every
    gradient once (XLA may reduce a tied weight's two parts apart, so up to
    twice its bytes); fsdp gathers parameters. A sharded step's prediction
    takes the compiled collectives; a replicated one keeps the planner's
    (its all-reduce is what the calibration fits the compute to)."""
    w = zoo.get("transformer", small=True, batch=4)
    args = w.example_args()
    step = hetpar.auto(w.train_step, devices=TWO, data_parallel=data_parallel)
    step(*args)
    summary = step.report().step
    got = summary["collectives"]
    grads = _param_bytes(args[0])
    compiled = got["compiled"]
    assert got["compiled_s"] == pytest.approx(ring_seconds(
        compiled, got["ring_bandwidth_bytes_per_s"], got["ring_latency_s"]))
    assert got["ring_latency_s"] > 0
    assert got["planned_s"] > 0 and not got["in_loops"]
    assert step.plan.predicted.step_time_s == pytest.approx(got["planned_step_s"])
    assert summary["first_call"]["phases"]["collectives"] >= 0
    if data_parallel == "always":
        assert set(compiled) == {"all-reduce"}
        assert grads <= compiled["all-reduce"]["ring_bytes"] <= 2 * grads
        assert summary["predicted_s"] == pytest.approx(got["planned_step_s"])
    else:
        assert compiled["all-gather"]["count"] > 0
        assert "all-reduce" in compiled or "reduce-scatter" in compiled
        assert summary["predicted_s"] == pytest.approx(
            got["planned_step_s"] - got["planned_s"] + got["compiled_s"])


def _scanned_step():
    """A plain-JAX step whose layers run under `lax.scan`, as users write deep
    stacks: under fsdp its collectives sit in the loop's body."""
    import jax.numpy as jnp
    import optax

    opt = optax.adam(1e-3)

    def step(params, opt_state, batch):
        def loss(p):
            def layer(h, w):
                return jnp.tanh(h @ w), None

            h, _ = jax.lax.scan(layer, batch, p["w"])
            return (h ** 2).mean()

        val, g = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, val

    params = {"w": jnp.ones((6, 16, 16)) * 0.05}
    return step, (params, opt.init(params), jnp.ones((8, 16)))


def test_collectives_in_a_loop_leave_the_planners_prediction():
    step_fn, args = _scanned_step()
    step = hetpar.auto(step_fn, devices=TWO, data_parallel="fsdp")
    step(*args)
    summary = step.report().step
    assert summary["collectives"]["in_loops"]
    assert summary["predicted_s"] == pytest.approx(step.plan.predicted.step_time_s)


def test_a_step_whose_collectives_cannot_be_read_keeps_its_results(monkeypatch):
    from hetpar.runtime._replicated import Replicated

    def broken(self, shapes):
        raise NotImplementedError("no HLO text on this backend")

    monkeypatch.setattr(Replicated, "executable", broken)
    w = zoo.get("mlp", small=True, batch=4)
    args = w.example_args()
    step = hetpar.auto(w.train_step, devices=TWO, data_parallel="fsdp")
    out = step(*args)
    assert len(out) == 3  # the step's results came back
    summary = step.report().step
    assert "collectives" not in summary
    assert summary["predicted_s"] == pytest.approx(step.plan.predicted.step_time_s)


def test_a_plan_on_one_device_reports_no_collectives():
    w = zoo.get("mlp", small=True, batch=4)
    step = hetpar.auto(w.train_step, devices=["cpu:0"])
    step(*w.example_args())
    assert "collectives" not in step.report().step


@pytest.mark.parametrize("n", [2, 4])
def test_the_ring_takes_bandwidth_from_large_sizes_and_latency_from_chained_allreduces(n):
    from hetpar.core import ring_allgather_s, ring_allreduce_s
    from hetpar.runtime._collective_bench import CHAIN, chain_latency, ring_bandwidth

    bw, lat, dispatch = 2.5e11, 2e-5, 4e-5
    sizes = (64 << 20, 512 << 20)
    big = tuple(ring_allgather_s(float(s), n, bw, lat) + dispatch for s in sizes)
    assert ring_bandwidth(n, sizes, big) == pytest.approx(bw)
    # A call's dispatch is in both chains' times, and each all-reduce of the
    # longer one adds its ring steps' latency and its bytes, nothing else.
    small = 64 << 10
    one, many = (dispatch + k * ring_allreduce_s(float(small), n, bw, lat) for k in (1, CHAIN))
    assert chain_latency(n, bw, small, (many - one) / (CHAIN - 1)) == pytest.approx(lat)
    # Noise of 0.2 ms on a call moves a ring step's latency by 0.2 ms / 32 /
    # its 2 (n - 1) steps, where a small call less a no-op's took it all.
    noisy = (many + 2e-4 - one) / (CHAIN - 1)
    assert chain_latency(n, bw, small, noisy) == pytest.approx(
        lat + 2e-4 / (CHAIN - 1) / (2 * (n - 1)))
    assert chain_latency(n, bw, small, 0.0) == 5e-6  # never below the floor


def test_ring_figures_time_chained_allreduces_on_cpu_devices():
    from hetpar._compiled_collectives import hlo_collectives
    from hetpar.runtime import ring_figures
    from hetpar.runtime._collective_bench import CHAIN, allreduce_chain

    cpus = jax.devices("cpu")[:2]
    bandwidth, latency = ring_figures(cpus, sizes=(1 << 20, 16 << 20))
    assert bandwidth > 0 and 5e-6 <= latency < 0.1
    # XLA keeps every all-reduce of the chain (none combined or simplified
    # away: the latency is what one more adds), and each sums its members.
    program, arg = allreduce_chain(cpus, CHAIN, 64 << 10)
    text = program.lower(arg).compile().as_text()
    assert hlo_collectives(text, 2)["all-reduce"]["count"] == CHAIN
    assert float(program(arg)[0]) == 2.0**CHAIN
