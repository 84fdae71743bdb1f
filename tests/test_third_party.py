"""Third-party models, their steps written the way each library's users write them.

Hugging Face Flax (GPT-2, BERT, BERT with gradient checkpointing) with the
optimizer and step of the Hugging Face Flax example scripts, and Haiku
(`hk.transform`), each under a plan that splits its layers over cpu:0 and
cpu:1, and with 2 microbatches. The only hetpar code in the steps is
`hetpar.auto` and, for microbatching, `hetpar.value_and_grad` in place of
`jax.value_and_grad`; the helpers below trace the step once for its layer names.

The oracle is tests/oracle.py's: at each of 3 steps, the same step under
`jax.jit` on cpu:0 applied to the state hetpar returned, every leaf (float
leaves on their own scale, PRNG keys and Adam's step count equal). Two
independent 3-step trajectories are not compared: Adam turns the rounding noise
on gradients that are zero in exact arithmetic (attention key biases: softmax
ignores a shift shared by all keys) into +-lr updates, so those leaves differ
between any two compilations of the step, `jax.jit` against itself equation by
equation included; the oracle's floor for them is that very gap.

Every test here is in the slow tier (~30 s of XLA compiles a Hugging Face case
on 2 cores); the fast tier's split and pipelined transformers are the zoo's
(tests/test_runtime.py).

Layer counts and layer structure are not checked here (tests/test_trace.py and
tests/test_user_steps.py do that).
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import hetpar

from . import oracle

# -- helpers ---------------------------------------------------------------


def half_plan(step, args):
    """First half of the step's layers on cpu:0, the rest on cpu:1."""
    layers = hetpar.trace(step, *args).layers
    half = max(1, len(layers) // 2)
    return {name: "cpu:0" if k < half else "cpu:1" for k, name in enumerate(layers)}


def check_equals_jit(auto_step, reference, args, steps=3):
    """`steps` steps of `auto_step`; each equals `jax.jit(reference)` on the
    same inputs, leaf by leaf (tests/oracle.py)."""
    oracle.check_steps_equal_jit(auto_step, reference, args, steps=steps)


# -- Hugging Face Flax -------------------------------------------------------

VOCAB, SEQ, BATCH = 64, 8, 4


def transformers_flax():
    """transformers, skipping the test where it is absent or has no Flax models (v5)."""
    transformers = pytest.importorskip("transformers")
    try:
        transformers.FlaxGPT2LMHeadModel  # noqa: B018 (lazy import: raises when absent)
    except (AttributeError, ImportError) as e:
        pytest.skip(f"this transformers has no Flax models: {e}")
    return transformers


# Models are built once per module (per xdist worker): Hugging Face builds their
# random weights op by op, ~10 s of XLA compiles on 2 cores.
@pytest.fixture(scope="module")
def gpt2():
    transformers = transformers_flax()
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=1,
                                     n_head=2)
    return transformers.FlaxGPT2LMHeadModel(config, seed=0)


def make_bert(gradient_checkpointing):
    transformers = transformers_flax()
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=SEQ)
    model = transformers.FlaxBertForMaskedLM(config, seed=0)
    if gradient_checkpointing:
        model.enable_gradient_checkpointing()
    return model


def token_batch():
    input_ids = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, VOCAB)
    return {"input_ids": input_ids, "attention_mask": jnp.ones_like(input_ids),
            "labels": input_ids}


# As run_clm_flax.py writes it: dropout on, its key carried in the state.
def clm_train_step(model, tx):
    def train_step(params, opt_state, dropout_rng, batch):
        dropout_rng, new_dropout_rng = jax.random.split(dropout_rng)

        def loss_fn(params):
            logits = model(batch["input_ids"], params=params, dropout_rng=dropout_rng,
                           train=True).logits
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1], batch["labels"][:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, new_dropout_rng, loss

    return train_step


# The evaluation-mode twin, with the loss closing over the batch; `value_and_grad`
# is jax's or hetpar's.
def clm_eval_mode_step(model, tx, value_and_grad):
    def train_step(params, opt_state, batch):
        def loss_fn(params):
            logits = model(batch["input_ids"], params=params, train=False).logits
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1], batch["labels"][:, 1:]).mean()

        loss, grads = value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


# As run_mlm_flax.py writes it (masked positions labelled, the rest -100), the loss
# averaged over the batch's tokens so that microbatches average to the full batch.
def mlm_step(model, tx, value_and_grad, train):
    def train_step(params, opt_state, dropout_rng, batch):
        dropout_rng, new_dropout_rng = jax.random.split(dropout_rng)

        def loss_fn(params):
            logits = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                           params=params, dropout_rng=dropout_rng, train=train).logits
            labels = batch["labels"]
            mask = labels != -100
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits, jnp.where(mask, labels, 0))
            return (loss * mask).sum() / labels.size

        loss, grads = value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, new_dropout_rng, loss

    return train_step


def hf_optimizer():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.01))


def mlm_batch():
    batch = token_batch()
    masked = jax.random.bernoulli(jax.random.key(2), 0.3, batch["input_ids"].shape)
    batch["labels"] = jnp.where(masked, batch["input_ids"], -100)
    return batch


# Slow, as every Hugging Face case here (~30 s of XLA compiles on 2 cores).
@pytest.mark.slow
def test_hf_gpt2_split_plan_equals_jit(gpt2):
    tx = hf_optimizer()
    train_step = clm_train_step(gpt2, tx)
    params = gpt2.params
    args = (params, tx.init(params), jax.random.PRNGKey(0), token_batch())
    step = hetpar.auto(train_step, plan=half_plan(train_step, args))
    check_equals_jit(step, train_step, args)


@pytest.mark.slow
def test_hf_gpt2_microbatched_closure_loss_equals_full_batch(gpt2):
    # loss_fn(params) closes over the batch; hetpar cuts what it reads per microbatch.
    tx = hf_optimizer()
    step_fn = clm_eval_mode_step(gpt2, tx, hetpar.value_and_grad)
    params = gpt2.params
    args = (params, tx.init(params), token_batch())
    step = hetpar.auto(step_fn, microbatches=2, plan=half_plan(step_fn, args))
    check_equals_jit(step, clm_eval_mode_step(gpt2, tx, jax.value_and_grad), args)


# run_clm_flax.py's loss pops the labels from the batch it closes over (here in
# evaluation mode, so that two microbatches average to the full batch).
def clm_pop_labels_step(model, tx, value_and_grad):
    def train_step(params, opt_state, batch):
        def compute_loss(params):
            labels = batch.pop("labels")
            logits = model(**batch, params=params, train=False)[0]
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1], labels[:, 1:]).mean()

        loss, grads = value_and_grad(compute_loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


@pytest.mark.slow
def test_hf_gpt2_loss_popping_labels_microbatched_equals_full_batch(gpt2):
    tx = hf_optimizer()
    step_fn = clm_pop_labels_step(gpt2, tx, hetpar.value_and_grad)
    params = gpt2.params
    args = (params, tx.init(params), token_batch())
    step = hetpar.auto(step_fn, microbatches=2, plan=half_plan(step_fn, args))
    check_equals_jit(step, clm_pop_labels_step(gpt2, tx, jax.value_and_grad), args)
    assert "labels" in args[-1]  # the caller's batch keeps its labels


# BERT's training step split in two is checked with gradient checkpointing on
# (remat inside the layers, dropout on); microbatched Hugging Face steps are
# GPT-2's above (CI time: ~30 s of compiles a BERT case on 2 cores).
@pytest.mark.slow
def test_hf_bert_gradient_checkpointing_split_plan_equals_jit():
    model = make_bert(gradient_checkpointing=True)
    tx = hf_optimizer()
    train_step = mlm_step(model, tx, jax.value_and_grad, train=True)
    args = (model.params, tx.init(model.params), jax.random.PRNGKey(0), mlm_batch())
    step = hetpar.auto(train_step, plan=half_plan(train_step, args))
    check_equals_jit(step, train_step, args)


# -- Haiku -------------------------------------------------------------------


def haiku_net():
    hk = pytest.importorskip("haiku")

    def forward(images):
        x = hk.Flatten()(images)
        x = hk.nets.MLP([32, 32], activate_final=True)(x)
        x = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)
        return hk.Linear(10)(x)

    return hk.without_apply_rng(hk.transform(forward))


def haiku_step(net, tx, value_and_grad):
    def loss_fn(params, images, labels):
        logits = net.apply(params, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def update(params, opt_state, batch):
        loss, grads = value_and_grad(loss_fn)(params, batch["images"], batch["labels"])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return update


def haiku_args(net, tx):
    images = jax.random.normal(jax.random.key(1), (BATCH, 8, 8, 1))
    labels = jax.random.randint(jax.random.key(2), (BATCH,), 0, 10)
    params = net.init(jax.random.key(0), images)
    return params, tx.init(params), {"images": images, "labels": labels}


@pytest.mark.slow
def test_haiku_split_plan_and_microbatches_equal_jit():
    net = haiku_net()
    tx = optax.adam(1e-3)
    update = haiku_step(net, tx, jax.value_and_grad)
    args = haiku_args(net, tx)
    step = hetpar.auto(update, plan=half_plan(update, args))
    check_equals_jit(step, update, args)

    mb_update = haiku_step(net, tx, hetpar.value_and_grad)
    step = hetpar.auto(mb_update, microbatches=2, plan=half_plan(mb_update, args))
    check_equals_jit(step, update, args)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["fsdp", "zero1"])
def test_haiku_with_sharded_state_over_two_devices_equals_jit(stage):
    """A Haiku step with clipped AdamW, its state split over two devices:
    each step equals `jax.jit`'s on the state hetpar returned."""
    net = haiku_net()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    update = haiku_step(net, tx, jax.value_and_grad)
    args = haiku_args(net, tx)
    step = hetpar.auto(update, devices=["cpu:0", "cpu:1"], data_parallel=stage)
    check_equals_jit(step, update, args)
    assert step.lower(*args).plan.sharding == stage


def test_haiku_clipped_adamw_with_weights_fetched_equals_jit():
    """A Haiku MLP trained with optax.chain(clip_by_global_norm, adamw), its
    parameters and state in cpu:0's pinned host memory and its weights
    fetched for each stage that reads them: under the global-norm clip each
    update waits for every gradient, so a layer's weights come in a third
    time for it. Equal to jit's step."""
    net = haiku_net()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    update = haiku_step(net, tx, jax.value_and_grad)
    args = haiku_args(net, tx)
    layers = hetpar.trace(update, *args).layers
    place = "cpu:0:pinned_host"
    fetched = {"compute": "cpu:0", "params": place, "state": place, "update": "cpu:0"}
    step = hetpar.auto(update, plan=dict.fromkeys(layers, fetched))
    check_equals_jit(step, update, args)
    ex = step._last._executor
    roles = dict(zip(ex._invars, ex.stages.graph.input_roles))
    reads = [sum(v in st.inputs for st in ex.stages.stages)
             for v, r in roles.items() if r == "param"]
    assert max(reads) == 3
    assert not any(roles.get(v) == "param" for v, _ in ex._cache_inputs)


@pytest.mark.parametrize("clip", [False, True])
def test_haiku_steps_say_which_updates_wait_for_every_gradient(clip):
    """The planner holds a streamed layer's gradient only in its backward
    where its update waits for no other (`quick_gradients`): it reads that
    from the cost table's `update_reads`, which a Haiku step's optax chain
    decides. Under clip_by_global_norm every update but the bottom layer's
    waits; under plain adamw none does, and the table says so (empty)."""
    from hetpar.cost_models import cost_table
    from hetpar.planner import Arrays

    net = haiku_net()
    tx = (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)) if clip
          else optax.adamw(1e-3))
    update = haiku_step(net, tx, jax.value_and_grad)
    graph = hetpar.trace(update, *haiku_args(net, tx))
    table = cost_table(graph, ["cpu:0"])
    reads = table.meta["update_reads"]
    waits = Arrays(table).waits
    if clip:
        # every layer with parameters but the bottom one, whose backward comes last
        trained = [n for n in graph.layers if graph[n].param_bytes]
        assert set(reads) == set(trained[1:]) and all(reads.values())
        assert waits.sum() == len(reads)
    else:
        assert reads == {} and not waits.any()
