"""Layers as users' model code defines them (issue 14, items 2-5).

Gradient checkpointing (`nn.remat`, `jax.checkpoint`), scanned stacks
(`nn.scan`), Equinox's class-named scopes and Hugging Face's deep module
trees must all give the planner one layer per module instance, each holding
its forward, its backward, its parameters, its update and its optimizer
state, in data-flow order and at a granularity without glue layers.

The models below are written as their libraries' users write them; the only
hetpar code is `hetpar.trace`. Tracing compiles nothing, so these run fast.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hetpar
from hetpar.passes import PARAM


def adam_step(apply, tx=None):
    tx = tx or optax.adam(1e-3)

    def train_step(params, opt_state, batch):
        def loss_fn(params):
            return jnp.mean((apply(params, batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step, tx


def updates_in_own_layer(graph) -> float:
    """Share of parameter leaves whose new value is computed in the layer that
    holds the parameter, with all optimizer state of that layer's leaves there."""
    program = graph.program
    jaxpr = program.jaxpr.jaxpr
    producer = {o: graph.eqn_layers[i] for i, e in enumerate(jaxpr.eqns) for o in e.outvars}
    params = [k for k, role in enumerate(graph.input_roles) if role == PARAM]
    # The step returns (params, opt_state, loss): new params come first, in order.
    own = sum(producer.get(jaxpr.outvars[n]) == graph.input_layers[k]
              for n, k in enumerate(params))
    return own / len(params)


def opt_state_layers(graph) -> set:
    return {layer for layer, role in zip(graph.input_layers, graph.input_roles)
            if role == "opt_state" and layer is not None}


# -- gradient checkpointing --------------------------------------------------


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        return x + nn.Dense(16)(nn.gelu(nn.Dense(32)(h)))


class Stack(nn.Module):
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        block = nn.remat(Block) if self.remat else Block
        x = nn.Dense(16, name="embed")(x)
        for i in range(3):
            x = block(name=f"block{i}")(x)
        return nn.Dense(4, name="head")(x)


def stack_graph(remat: bool):
    model = Stack(remat=remat)
    x = jnp.ones((4, 8))
    params = model.init(jax.random.key(0), x)
    step, tx = adam_step(model.apply)
    return hetpar.trace(step, params, tx.init(params), {"x": x, "y": jnp.ones((4, 4))})


@pytest.mark.slow  # fast-tier time; user_steps[remat] runs remat fast
def test_remat_backward_lands_with_its_forward():
    plain, remat = stack_graph(False), stack_graph(True)
    assert remat.layers == plain.layers == ["embed", "block0", "block1", "block2", "head"]
    eqns = remat.program.eqns
    rematted = [i for i, e in enumerate(eqns) if e.primitive.name in ("checkpoint", "remat2")]
    assert len(rematted) == 3  # one recomputed backward per block
    assert [remat.eqn_layers[i] for i in rematted] == ["block2", "block1", "block0"]
    for name in ("block0", "block1", "block2"):
        # The same layer with remat does the forward twice, so more work, never less.
        assert remat[name].flops >= plain[name].flops > 0
        assert remat[name].param_bytes == plain[name].param_bytes
    assert updates_in_own_layer(remat) == 1.0


def test_jax_checkpoint_in_plain_jax_with_named_layers():
    def layer_fn(w, x):
        return jnp.tanh(x @ w)

    def apply(params, x):
        for i, w in enumerate(params):
            with hetpar.layer(f"dense{i}"):
                x = jax.checkpoint(layer_fn)(w, x)
        return x

    params = [jnp.ones((8, 8)) * 0.1 for _ in range(3)]
    step, tx = adam_step(apply)
    g = hetpar.trace(step, params, tx.init(params), {"x": jnp.ones((4, 8)), "y": jnp.ones((4, 8))})
    assert g.layers == ["dense0", "dense1", "dense2"]
    assert all(g[n].param_bytes == 8 * 8 * 4 for n in g.layers)
    assert updates_in_own_layer(g) == 1.0


# -- scanned stacks ----------------------------------------------------------


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        # Loop-invariant work (a position bias, a causal mask): JAX hoists it
        # out of the scan with the body's relative name stack.
        x = x + jnp.sqrt(jnp.arange(x.shape[-1], dtype=x.dtype)) / 100.0
        return x + nn.Dense(16)(nn.gelu(nn.Dense(16)(x))), None


class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, name="embed")(x)
        x, _ = nn.scan(ScanBlock, variable_axes={"params": 0},
                       split_rngs={"params": True}, length=4)(name="blocks")(x, None)
        return nn.Dense(4, name="head")(x)


def test_scan_forward_and_backward_belong_to_the_stack():
    model = Scanned()
    x = jnp.ones((4, 8))
    params = model.init(jax.random.key(0), x)
    step, tx = adam_step(model.apply)
    g = hetpar.trace(step, params, tx.init(params), {"x": x, "y": jnp.ones((4, 4))})
    assert g.layers == ["embed", "blocks", "head"]
    scans = [i for i, e in enumerate(g.program.eqns) if e.primitive.name == "scan"]
    assert len(scans) == 2  # forward and backward
    assert {g.eqn_layers[i] for i in scans} == {"blocks"}
    # The stacked kernels (4 x (16x16 + 16) x 2) and their Adam moments live there.
    assert g["blocks"].param_bytes == 4 * 2 * (16 * 16 + 16) * 4
    assert g["blocks"].opt_state_bytes == 2 * g["blocks"].param_bytes
    assert g["blocks"].flops > 0.8 * sum(g[n].flops for n in g.layers)
    assert updates_in_own_layer(g) == 1.0
    assert any("blocks" in note and "scan" in note for note in g.notes)


def test_lax_scan_over_a_layer_axis():
    def apply(params, x):
        def body(h, w):
            with hetpar.layer("stack"):
                return jnp.tanh(h @ w), None

        with hetpar.layer("embed"):
            x = x @ params["embed"]
        x, _ = jax.lax.scan(body, x, params["stack"])
        with hetpar.layer("head"):
            return x @ params["head"]

    params = {"embed": jnp.ones((8, 16)) * 0.1, "stack": jnp.ones((6, 16, 16)) * 0.1,
              "head": jnp.ones((16, 4)) * 0.1}
    step, tx = adam_step(apply)
    g = hetpar.trace(step, params, tx.init(params), {"x": jnp.ones((4, 8)), "y": jnp.ones((4, 4))})
    assert g.layers == ["embed", "stack", "head"]
    assert g["stack"].param_bytes == 6 * 16 * 16 * 4
    assert updates_in_own_layer(g) == 1.0


# -- Equinox: instances of one class ----------------------------------------


def test_equinox_mlp_gives_one_layer_per_linear():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(8, 4, 16, 3, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    tx = optax.adam(1e-3)

    def step(params, opt_state, x, y):
        model = eqx.combine(params, static)

        def loss(model):
            return jnp.mean((jax.vmap(model)(x) - y) ** 2)

        loss_value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        new = eqx.apply_updates(model, updates)
        return eqx.filter(new, eqx.is_array), opt_state, loss_value

    g = hetpar.trace(step, params, tx.init(params), jnp.ones((4, 8)), jnp.ones((4, 4)),
                     batch_argnums=(2, 3))
    assert g.layers == ["layers[0]", "layers[1]", "layers[2]", "layers[3]"]
    sizes = [(8 * 16 + 16), (16 * 16 + 16), (16 * 16 + 16), (16 * 4 + 4)]
    assert [g[n].param_bytes for n in g.layers] == [4 * s for s in sizes]
    assert [g[n].opt_state_bytes for n in g.layers] == [8 * s for s in sizes]
    assert updates_in_own_layer(g) == 1.0


def test_flax_names_are_never_split_into_instances():
    # A module applied twice (tied weights) reads one owner: one layer.
    class Tied(nn.Module):
        @nn.compact
        def __call__(self, x):
            tied = nn.Dense(8, name="tied")
            return nn.Dense(4, name="head")(tied(nn.relu(tied(x))))

    model = Tied()
    x = jnp.ones((4, 8))
    params = model.init(jax.random.key(0), x)
    step, tx = adam_step(model.apply)
    g = hetpar.trace(step, params, tx.init(params), {"x": x, "y": jnp.ones((4, 4))})
    assert g.layers == ["tied", "head"]


# -- order and granularity ---------------------------------------------------


class Decoder(nn.Module):
    def setup(self):
        self.position = nn.Embed(16, 8)
        self.dense = nn.Dense(8)

    def bias(self, n):
        return self.position(jnp.arange(n))

    def __call__(self, h, bias):
        return self.dense(h) + bias


class EncoderDecoder(nn.Module):
    """The decoder's position bias is computed before the encoder runs (as
    T5's is), but the decoder reads the encoder's output."""

    def setup(self):
        self.encoder = nn.Dense(8)
        self.decoder = Decoder()

    def __call__(self, x):
        bias = self.decoder.bias(x.shape[-2])
        return self.decoder(nn.relu(self.encoder(x)), bias)


def test_layers_come_in_data_flow_order():
    model = EncoderDecoder()
    x = jnp.ones((2, 6, 8))
    params = model.init(jax.random.key(0), x)
    step, tx = adam_step(model.apply)
    g = hetpar.trace(step, params, tx.init(params), {"x": x, "y": jnp.ones((2, 6, 8))},
                     depth=1)
    first = {n: min(g[n].eqns) for n in g.layers}
    assert first["decoder"] < first["encoder"]  # program order says decoder first...
    assert g.layers == ["encoder", "decoder"]  # ...data flow says encoder


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(16, name="output")(nn.gelu(nn.Dense(32, name="intermediate")(x)))


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = Layer(name=str(i))(x)
        return x


class Body(nn.Module):
    """Hugging Face's shape: model -> bert -> {embeddings, encoder -> layer -> i}, cls."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, name="embeddings")(x)
        x = nn.Dropout(0.0, deterministic=True, name="dropout")(x)
        x = x * 1.0  # glue at the `bert` scope
        return EncoderStack(name="encoder")(x)


class EncoderStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Encoder(name="layer")(x)


class ForMaskedLM(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="cls")(Body(name="bert")(x))


def test_default_granularity_finds_the_blocks():
    model = ForMaskedLM()
    x = jnp.ones((4, 8))
    params = model.init(jax.random.key(0), x)
    step, tx = adam_step(model.apply)
    batch = {"x": x, "y": jnp.ones((4, 8))}
    g = hetpar.trace(step, params, tx.init(params), batch)
    assert g.layers == ["bert/embeddings", "bert/encoder/layer/0", "bert/encoder/layer/1",
                        "bert/encoder/layer/2", "cls"]
    assert all(g[n].param_bytes > 0 for n in g.layers)  # no glue layers
    assert updates_in_own_layer(g) == 1.0
    # An explicit depth still means what it says.
    assert hetpar.trace(step, params, tx.init(params), batch, depth=1).layers == ["bert", "cls"]


# -- Hugging Face Flax models, when installed --------------------------------


def _hf():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlaxGPT2LMHeadModel"):
        pytest.skip("this transformers has no Flax models")
    return transformers


def hf_step(forward):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

    def train_step(params, opt_state, batch):
        def loss_fn(params):
            logits = forward(params, batch)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["labels"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step, tx


@pytest.mark.slow  # building a Hugging Face model compiles its initialiser: ~10-30 s
def test_hf_gpt2_layers():
    t = _hf()
    model = t.FlaxGPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                               n_positions=16), seed=0, input_shape=(1, 8))
    step, tx = hf_step(lambda p, b: model(b["input_ids"], params=p).logits)
    ids = jnp.zeros((2, 8), jnp.int32)
    g = hetpar.trace(step, model.params, tx.init(model.params),
                     {"input_ids": ids, "labels": ids})
    assert g.layers == ["transformer/wte", "transformer/wpe", "transformer/h/0",
                        "transformer/h/1", "transformer/ln_f", "lm_head"]
    assert updates_in_own_layer(g) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_hf_bert_layers(checkpointing):
    t = _hf()
    model = t.FlaxBertForMaskedLM(t.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=64, max_position_embeddings=16), seed=0, input_shape=(1, 8))
    if checkpointing:
        model.enable_gradient_checkpointing()
    step, tx = hf_step(lambda p, b: model(b["input_ids"], params=p).logits)
    ids = jnp.zeros((2, 8), jnp.int32)
    g = hetpar.trace(step, model.params, tx.init(model.params),
                     {"input_ids": ids, "labels": ids})
    assert g.layers == ["bert/embeddings", "bert/encoder/layer/0", "bert/encoder/layer/1", "cls"]
    assert updates_in_own_layer(g) == 1.0
    total = sum(g[n].flops for n in g.layers)
    for name in ("bert/encoder/layer/0", "bert/encoder/layer/1"):
        assert 0.3 < g[name].flops / total < 0.5


def test_work_hoisted_out_of_a_scan_stays_under_the_root():
    from hetpar.passes._layers import _strip_root

    # JAX hoists a scan body's loop-invariant work (a causal mask) out of the
    # scan with the body's relative stack: `blocks/...`, no model root.
    paths = [("M", "embed")] * 5 + [("M", "blocks", "Dense_0")] * 3 + [("blocks", "mask")] * 4
    assert _strip_root(paths) == ([("embed",)] * 5 + [("blocks", "Dense_0")] * 3
                                  + [("blocks", "mask")] * 4)


def test_equinox_module_passed_whole_keeps_its_roles():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(8, 4, 16, 3, key=jax.random.key(0))  # holds jax.nn.relu: static
    tx = optax.adam(1e-3)

    def step(model, opt_state, x, y):
        def loss(model):
            return jnp.mean((jax.vmap(model)(x) - y) ** 2)

        loss_value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss_value

    g = hetpar.trace(step, model, tx.init(eqx.filter(model, eqx.is_array)),
                     jnp.ones((4, 8)), jnp.ones((4, 4)), batch_argnums=(2, 3))
    assert g.layers == ["layers[0]", "layers[1]", "layers[2]", "layers[3]"]
    roles = list(g.input_roles)
    assert roles.count("param") == 8 and roles[-2:] == ["batch", "batch"]
    assert updates_in_own_layer(g) == 1.0


# -- glue between modules ---------------------------------------------------


class PooledConvs(nn.Module):
    """A stem, a max-pool in the parent's own code (as Flax's ResNet calls
    `nn.max_pool`), then a block: the pool belongs to no module."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), name="stem")(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(8, (3, 3), name="block")(x))
        return x.mean(axis=(1, 2))


def test_glue_and_its_gradient_join_the_same_layer():
    """Unnamed glue between two layers joins the earlier (its producer) and
    so does its gradient: the cut between them then carries the pooled
    activation forward and its cotangent back (2 x 8x8x8 floats a image),
    not also the stem's 4x larger output forward and its cotangent back."""
    model = PooledConvs()
    x = jnp.ones((2, 16, 16, 3))
    params = model.init(jax.random.PRNGKey(0), x)
    step, tx = adam_step(model.apply)
    batch = {"x": x, "y": jnp.ones((2, 8))}
    graph = hetpar.trace(step, params, tx.init(params), batch)

    eqns = graph.program.jaxpr.jaxpr.eqns
    where = {eqns[i].primitive.name: graph.eqn_layers[i] for i in range(len(eqns))}
    assert where["reduce_window_max"] == where["select_and_scatter_add"] == "stem"
    edge = graph.graph.edges["stem", "block"]
    pooled = 2 * 8 * 8 * 8 * 4
    assert edge["bytes"] == pooled and edge["bytes_backward"] == pooled


def test_glue_gradient_never_goes_to_a_layer_without_a_backward():
    """`lm_embed` masks its embeddings with `x * mask`, the mask from the
    parameter-free `vectorize` layer: the product's gradient stays with the
    embedding (a layer with a backward of its own), so `vectorize` gains no
    backward stage and the cut after it carries no gradient."""
    from hetpar import zoo
    from hetpar.passes import is_backward

    graph = zoo.trace_model("lm_embed", small=True)[1]
    eqns = graph.program.jaxpr.jaxpr.eqns
    assert not any(is_backward(str(eqns[i].source_info.name_stack))
                   for i in graph["vectorize"].eqns)
    assert graph.graph.edges["vectorize", "embedding"]["bytes_backward"] == 0


class Film(nn.Module):
    """A gate written in the parent: `tanh(h) * g` reads two modules' results."""

    @nn.compact
    def __call__(self, x):
        g = nn.Dense(16, name="A")(x)
        h = nn.Dense(16, name="B")(x)
        h = nn.Dense(16, name="B2")(jnp.tanh(h))
        return nn.Dense(3, name="C")(jnp.tanh(h) * g)


def backward_results_sent_forward(graph) -> list:
    """(producer layer, reader layer) of every value a backward equation makes
    that a later layer reads: a gradient moving forward during the backward."""
    from hetpar.passes import is_backward

    eqns = graph.program.jaxpr.jaxpr.eqns
    order = {name: k for k, name in enumerate(graph.layers)}
    made = {o: i for i, e in enumerate(eqns) for o in e.outvars
            if isinstance(o, jax.extend.core.Var)}
    out = []
    for j, e in enumerate(eqns):
        for a in e.invars:
            i = made.get(a) if isinstance(a, jax.extend.core.Var) else None
            if i is None or not is_backward(str(eqns[i].source_info.name_stack)):
                continue
            src, dst = graph.eqn_layers[i], graph.eqn_layers[j]
            if src in order and dst in order and order[src] < order[dst]:
                out.append((src, dst))
    return out


def test_a_gate_in_the_parent_keeps_its_gradient_out_of_the_earlier_layer():
    """The gate's gradient reads `C`'s cotangent and both inputs; were it in
    `A` (the earliest), its gradient for `B2` would move forward, A to B2,
    during the backward. It stays in the latest layer that reads it."""
    model = Film()
    x = jnp.ones((4, 5))
    params = model.init(jax.random.PRNGKey(0), x)
    step, tx = adam_step(model.apply)
    graph = hetpar.trace(step, params, tx.init(params), {"x": x, "y": jnp.ones((4, 3))})
    assert backward_results_sent_forward(graph) == []
    # and the pool case keeps its gradient with the stem (the test above), likewise
    pooled = PooledConvs()
    xi = jnp.ones((2, 16, 16, 3))
    p2 = pooled.init(jax.random.PRNGKey(0), xi)
    step2, tx2 = adam_step(pooled.apply)
    g2 = hetpar.trace(step2, p2, tx2.init(p2), {"x": xi, "y": jnp.ones((2, 8))})
    assert backward_results_sent_forward(g2) == []


# -- code without module names (issue 44, item 3) ----------------------------


def llama_params(blocks=4, width=16, vocab=32, key=0):
    """A plain-JAX Llama-style model's parameters, as a dict of arrays."""
    keys = iter(jax.random.split(jax.random.key(key), 7 * blocks + 2))

    def dense(n, m):
        return jax.random.normal(next(keys), (n, m)) / jnp.sqrt(n)

    return {
        "embed": dense(vocab, width),
        "blocks": [{"attn_norm": jnp.ones(width), "wq": dense(width, width),
                    "wk": dense(width, width), "wv": dense(width, width),
                    "wo": dense(width, width), "mlp_norm": jnp.ones(width),
                    "w1": dense(width, 2 * width), "w3": dense(width, 2 * width),
                    "w2": dense(2 * width, width)} for _ in range(blocks)],
        "norm": jnp.ones(width),
        "head": dense(width, vocab),
    }


def rms_norm(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w


def llama_block(p, x, heads=2):
    b, t, d = x.shape
    h = rms_norm(x, p["attn_norm"])
    q, k, v = ((h @ p[w]).reshape(b, t, heads, d // heads) for w in ("wq", "wk", "wv"))
    x = x + jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d) @ p["wo"]
    h = rms_norm(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]


def llama_step(checkpoint=False, tx=None, blocks=4):
    tx = tx or optax.adam(1e-3)
    block = jax.checkpoint(llama_block) if checkpoint else llama_block

    def train_step(params, opt_state, batch):
        def loss_fn(params):
            x = params["embed"][batch["tokens"]]
            for p in params["blocks"]:
                x = block(p, x)
            logits = rms_norm(x, params["norm"]) @ params["head"]
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["labels"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = llama_params(blocks)
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 32)
    return train_step, (params, tx.init(params), {"tokens": tokens,
                                                  "labels": jnp.roll(tokens, -1, 1)})


def largest_opt_state_share(graph) -> float:
    held = [graph[n].opt_state_bytes for n in graph.layers]
    return max(held) / sum(held)


LLAMA_LAYERS = ["embed", "blocks[0]", "blocks[1]", "blocks[2]", "blocks[3]", "norm", "head"]


@pytest.mark.parametrize("checkpoint", [False, True])
def test_plain_jax_blocks_are_the_layers(checkpoint):
    # jax.nn.dot_product_attention runs jnp.einsum, whose subscripts
    # (`BTNH,BSNH->BNTS`) were the only names: two layers held everything.
    step, args = llama_step(checkpoint)
    g = hetpar.trace(step, *args)
    assert g.layers == LLAMA_LAYERS
    assert largest_opt_state_share(g) < 0.3
    block = sum(x.nbytes for x in jax.tree.leaves(args[0]["blocks"][0]))
    assert all(g[f"blocks[{k}]"].param_bytes == block for k in range(4))
    assert updates_in_own_layer(g) == 1.0


@pytest.mark.slow  # ~15 s of compiling on 2 cores; the Equinox block stack splits fast
def test_plain_jax_blocks_split_over_two_devices_equal_jit():
    step, args = llama_step(blocks=2)  # two blocks: fast-tier compile time
    layers = hetpar.trace(step, *args).layers
    assert layers == ["embed", "blocks[0]", "blocks[1]", "norm", "head"]
    # The cut falls between the blocks: few stages to compile.
    auto = hetpar.auto(step, plan={n: f"cpu:{int(k >= 2)}" for k, n in enumerate(layers)})
    state, ref = args[:2], args[:2]
    for _ in range(2):
        *state, loss = auto(*state, args[2])
        *ref, ref_loss = jax.jit(step)(*ref, args[2])
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# -- optimizers that read the parameter itself (issue 44, item 8) ------------


class Embedded(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(32, 16, name="wte")(tokens)
        for i in range(2):
            x = Block(name=f"h{i}")(x)
        return nn.Dense(32, name="head")(nn.LayerNorm(name="ln_f")(x))


def embedded_graph(tx):
    model = Embedded()
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 32)
    params = model.init(jax.random.key(0), tokens)

    def train_step(params, opt_state, batch):
        def loss_fn(params):
            logits = model.apply(params, batch["tokens"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["tokens"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return hetpar.trace(train_step, params, tx.init(params), {"tokens": tokens})


@pytest.mark.slow  # 3-5 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_adafactor_parameter_scale_stays_with_its_parameter():
    def edges(g):
        return {(u, v): (d["bytes"], d["bytes_backward"]) for u, v, d in g.graph.edges(data=True)}

    adam = embedded_graph(optax.adam(1e-3))
    adafactor = embedded_graph(optax.adafactor(1e-3))
    # rms(wte) ran in ln_f, which then received the whole table every step.
    assert edges(adafactor) == edges(adam)
    assert updates_in_own_layer(adafactor) == 1.0
