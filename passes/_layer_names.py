"""Layer names from key paths: which module instance an equation runs in.

Flax names every module in the name stack; other code does not. Equinox
names scopes by class only (`eqx.nn.MLP/eqx.nn.Linear`), and plain JAX and
Flax NNX name nothing. This module names such equations by the parameters
they read, and picks how deep a name goes:

- `split_instances`: a scope that stands for several instances of one class
  (the Linears of an MLP, a user's blocks) becomes the instance's key path
  (`blocks[0]/attn/query_proj`), level by level;
- `owner_paths`: code that names nothing takes the key path of the one
  owner whose parameters it reads (`params['blocks'][0]['wq']` ->
  `blocks[0]`);
- `balanced_names`: the granularity (`depth=None`): the model's children,
  the heaviest split into its submodules while there are too few layers or
  one holds most of the FLOPs.

The layering rules that place everything else (`_layers`, rules 2-6) use
these names; docs/architecture/layers.md, rule 1, explains them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from jax.extend import core as jcore

from hetpar.passes._tiny import is_tiny


def _common_prefix(paths: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
    first = paths[0]
    n = len(first)
    for p in paths[1:]:
        n = min(n, len(p))
        while n and p[:n] != first[:n]:
            n -= 1
    return first[:n]


def owner_paths(eqns, invars, in_paths: Sequence[str], params: set) -> list[tuple[str, ...]]:
    """Module paths for code that names nothing (plain JAX, Flax NNX): each
    equation that reads the parameters of one owner gets the owner's path.

    A parameter's owner is its key path without the argument it came in and
    without its own name (`params['blocks'][0]['wq']` -> `blocks[0]`; an NNX
    `model.blocks[0].attn.query.kernel` -> `blocks[0]/attn/query`); a
    parameter at the top of its argument (`params['embed']`, a bare `pos`)
    is its own owner. The residual blocks a step loops over are then its
    layers, named as the user's parameters are (`balanced_names` chooses the
    depth); equations that read no parameter, or those of several owners,
    stay unnamed and follow the data (rules 2-5). Paths are all empty when
    the parameters say nothing (a single array, or a flat list of arrays:
    their keys are indices only), so that automatic clustering takes over.
    """
    index = {v: k for k, v in enumerate(invars)}
    owner: dict[jcore.Var, tuple[str, ...]] = {}
    for v in params:
        # `.value`: an NNX Variable's array.
        keys = [k for k in _KEY.findall(in_paths[index[v]])[1:] if k != ".value"]
        if not any(map(_is_name, keys)):
            continue  # indices only: nothing a user would read as a name
        parts = key_components(keys)
        owner[v] = parts[:-1] if _is_name(keys[-1]) and len(parts) > 1 else parts
    if len(set(owner.values())) < 2:
        return [()] * len(eqns)
    out: list[tuple[str, ...]] = []
    for e in eqns:
        found = {owner[a] for a in e.invars if isinstance(a, jcore.Var) and a in owner}
        out.append(found.pop() if len(found) == 1 else ())
    return out


#: Balanced granularity (`depth=None`): split a layer into its submodules
#: while there are fewer than MIN_LAYERS layers, or while one holds more than
#: MAX_SHARE of the step's FLOPs; never beyond MAX_LAYERS.
MIN_LAYERS = 4
MAX_SHARE = 0.5
MAX_LAYERS = 64


def balanced_names(paths: Sequence[tuple[str, ...]], weights: Sequence[float],
                   holds_state: Sequence[bool] | None = None) -> list[str | None]:
    """Layer names from module paths at a granularity that fits the model.

    A fixed depth fits no library: Hugging Face models have two children
    (`bert`, `cls`) and their blocks sit at depth 3 or 4 beside embeddings
    at depth 2. Starting from the model's children, the heaviest layer that
    has two or more submodules doing work is replaced by them while there are
    fewer than MIN_LAYERS layers or it holds more than MAX_SHARE of the FLOPs
    (a chain of single submodules, `bert/encoder/layer`, is walked through).
    GPT-2 becomes `transformer/wte, transformer/wpe, transformer/h/0, ...,
    lm_head`. Equations named at exactly a split scope (glue between its
    submodules) are left unnamed, and so is a submodule of a split layer
    that reads no step input and does under 1% of the work (a dropout): no
    glue layer forms; rules 2-5 place them by data flow. The model's own
    children are kept as named.

    Args:
      paths: module path of every equation (root stripped).
      weights: FLOPs of every equation.
      holds_state: per equation, whether it reads a step input (a parameter):
        a submodule that does so is kept however light it is (an embedding).
    """
    total = sum(weights) or 1.0
    holds = holds_state if holds_state is not None else [False] * len(paths)
    weight: Counter = Counter()
    stateful: set = set()
    children: dict[tuple, list[tuple]] = {}
    for p, w, h in zip(paths, weights, holds):
        for k in range(1, len(p) + 1):
            q = p[:k]
            if q not in weight and k > 1:
                children.setdefault(p[:k - 1], []).append(q)
            weight[q] += w
            if h:
                stateful.add(q)

    def real(q) -> bool:  # a submodule worth a layer of its own
        return q in stateful or weight[q] >= 0.01 * total

    def expand(q) -> list | None:
        """What replaces `q` when it is split, or None when it cannot be."""
        kids = [c for c in children.get(q, ()) if real(c)]
        if len(kids) == 1:
            return expand(kids[0])
        return kids if len(kids) >= 2 else None

    layers = [q for q in weight if len(q) == 1]  # the model's children, as named
    while len(layers) < MAX_LAYERS:
        options = [(weight[q], q, e) for q in layers if (e := expand(q)) is not None]
        if not options:
            break
        w, heaviest, parts = max(options, key=lambda t: t[0])
        if len(layers) >= MIN_LAYERS and w <= MAX_SHARE * total:
            break
        at = layers.index(heaviest)
        layers[at:at + 1] = parts
    chosen = set(layers)
    names: list[str | None] = []
    for p in paths:
        k = next((k for k in range(len(p), 0, -1) if p[:k] in chosen), 0)
        names.append("/".join(p[:k]) or None)
    return names


_KEY = re.compile(r"\[[^\]]*\]|\.[^.\[]+")


def _render(keys: Sequence[str]) -> str:
    """`('.layers', '[0]')` -> `layers[0]`; `("['params']", "['h']")` -> `params/h`."""
    out = ""
    for k in keys:
        if k.startswith("['") or k.startswith('["'):
            out += "/" + k[2:-2]
        else:
            out += k
    return out.lstrip("./")


def _is_name(key: str) -> bool:
    """Whether a key is a name (`.ln`, `['wq']`), not a list index (`[0]`)."""
    return not key.startswith("[") or key[1:2] in ("'", '"')


def key_components(keys: Sequence[str]) -> tuple[str, ...]:
    """Path components of a key path: each name starts one, an index joins
    the name before it. `('.blocks', '[0]', '.ln')` -> `('blocks[0]', 'ln')`;
    `("['blocks']", '[0]', "['wq']")` -> `('blocks[0]', 'wq')`."""
    out: list[str] = []
    for k in keys:
        if k.startswith("['") or k.startswith('["'):
            out.append(k[2:-2])
        elif k.startswith("[") and out:
            out[-1] += k
        else:
            out.append(k.lstrip("."))
    return tuple(out)


def split_instances(eqns, paths: Sequence[tuple[str, ...]], invars, in_paths: Sequence[str],
                    in_types: Sequence[tuple[str, ...]] = ()) -> list[tuple[str, ...]]:
    """Tells apart module instances that share one scope name.

    Equinox names scopes by class (`eqx.nn.MLP/eqx.nn.Linear`), so the four
    Linears of an MLP share one path, and a user's own modules (a block
    holding two LayerNorms and a Linear) name nothing. When the parameters a
    scope reads sit in instances of the scope's class (`in_types`: the
    `LayerNorm` nodes on their key paths), the scope's component is replaced
    by the instance's key path below the enclosing instance: `blocks[0]/ln1`
    and `ln_f` for `eqx.nn.LayerNorm`, then `query_proj` inside
    `blocks[0]/attn`; so the equations of one user block share its first
    component (`blocks[0]`) whatever classes they run. Without class
    information, when one module path reads the parameters of several
    owners (sibling subtrees of the argument holding the parameters:
    `model.layers[0]`, `model.layers[1]`, ...), that path component is
    replaced by the owner (`layers[0]`), level by level. Flax names every
    instance, so its paths never read two owners and are returned
    unchanged; a module applied twice (tied weights) reads one owner and
    stays one.
    """
    index = {v: k for k, v in enumerate(invars)}
    keys = [tuple(_KEY.findall(p)) for p in in_paths]
    types = [t if k < len(in_types) and len(t := in_types[k]) == len(keys[k]) else None
             for k in range(len(keys))]
    reads = [[index[a] for a in e.invars if isinstance(a, jcore.Var) and a in index
              and not is_tiny(a)] for e in eqns]
    paths = list(paths)
    downstream: dict = {}  # var -> every equation that reads it
    for i, e in enumerate(eqns):
        for a in e.invars:
            if isinstance(a, jcore.Var):
                downstream.setdefault(a, []).append(i)
    within: dict[int, tuple] = {}  # equation -> key path of the instance it was given
    level = 0
    while level < 32:
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(paths):
            if len(p) > level:
                groups.setdefault(p[:level + 1], []).append(i)
        if not groups:
            break
        for prefix, members in groups.items():
            owner = _instance_owners(eqns, members, paths, reads, keys, types, prefix[-1],
                                     downstream)
            for i, o in owner.items():
                outer = within.get(i)
                below = o[len(outer):] if outer and o[:len(outer)] == outer else o[1:]
                name = key_components(below)
                if not name:
                    continue
                within[i] = o
                p = paths[i]
                paths[i] = p[:level] + name + p[level + 1:]
        level += 1
    return paths


def _class_owner(read, keys, types, cls: str):
    """`owner_of(k)` for scopes named after a class: the deepest instance of
    `cls` on parameter k's key path (None when none is); None when no
    parameter the scope reads lies in one."""
    def owner_of(k: int):
        t = types[k]
        if t is None:
            return None
        at = [j for j in range(len(t) - 1) if t[j] == cls]
        return keys[k][:at[-1] + 1] if at else None

    return owner_of if any(owner_of(k) is not None for k in read) else None


def _instance_owners(eqns, members: list[int], paths, reads, keys, types, scope: str,
                     downstream: dict) -> dict[int, tuple]:
    """{equation: owner's key path} for a group of equations under one scope
    when that scope stands for instances (see `split_instances`); else {}.

    Not instances: a scope whose name is a key of the parameters it reads
    (Flax's `['params']['bn1']` and `['batch_stats']['bn1']` are one
    BatchNorm), and equations that read several owners at once (an LSTM
    cell's fused gate kernels).
    """
    read = {k for i in members for k in reads[i] if keys[k]}
    if not read:
        return {}
    named = {f"['{scope}']", f".{scope}", f'["{scope}"]'}
    if any(named & set(keys[k]) for k in read):
        return {}
    owner_of = _class_owner(read, keys, types, scope.rsplit(".", 1)[-1])
    by_class = owner_of is not None
    if not by_class:
        if len(read) < 2:
            return {}
        arg = Counter(keys[k][0] for k in read).most_common(1)[0][0]
        params = [keys[k] for k in read if keys[k][0] == arg]
        common = _common_prefix(params)
        n = len(common)

        def owner_of(k: int):
            key = keys[k]
            return key[:n + 1] if key[:n] == common and len(key) > n + 1 else None

    owners_by_path: dict[tuple, set] = {}
    inst: dict[int, tuple] = {}
    for i in members:
        found = [o for k in reads[i] if (o := owner_of(k)) is not None]
        if len(set(found)) > 1:
            return {}
        if found:
            owners_by_path.setdefault(paths[i], set()).update(found)
            inst[i] = found[0]
    owners = set(inst.values())
    if not owners or (not by_class and not any(len(s) >= 2 for s in owners_by_path.values())):
        return {}
    if len(owners) == 1:  # one instance of the class: all of the group is it
        return dict.fromkeys(members, owners.pop())
    # The rest of the group (bias gradients, reshapes, the backward's matmul
    # with saved inputs) joins the instance it shares data with: an input read
    # by an instance's equation, then a consumer, then a producer.
    producer = {o: i for i in members for o in eqns[i].outvars}
    readers: dict = {}
    for i in members:
        for a in eqns[i].invars:
            if isinstance(a, jcore.Var):
                readers.setdefault(a, []).append(i)
    for relation in ("sibling", "consumer", "producer"):
        changed = True
        while changed:
            changed = False
            for i in members:
                if i in inst:
                    continue
                # Only an unambiguous relation decides: q, k and v projections
                # all read the same input, which says nothing.
                found = {inst[j] for j in _related(eqns[i], relation, readers, producer)
                         if j in inst}
                if len(found) == 1:
                    inst[i] = found.pop()
                    changed = True
    # A weight gradient whose inputs are all shared (the first block's q, k
    # and v read the batch) is told apart by where it goes: the update of
    # its own parameter (one of this group's: the search may reach others').
    for i in members:
        if i not in inst:
            found = {o for j in _reachable(eqns, i, downstream) for k in reads[j]
                     if (o := owner_of(k)) in owners}
            if len(found) == 1:
                inst[i] = found.pop()
    resolved = sorted(inst)
    for i in members:
        if i not in inst and resolved:
            inst[i] = inst[min(resolved, key=lambda j: abs(j - i))]
    if by_class:
        return inst
    # Each instance is named by all it reads (`blocks[0].attn`, not `blocks[0]`).
    read_by: dict[tuple, list[tuple]] = {}
    for i, o in inst.items():
        read_by.setdefault(o, []).extend(keys[k] for k in reads[i] if owner_of(k) == o)
    full = {}
    for o, ks in read_by.items():
        c = _common_prefix(ks) if ks else o
        full[o] = c[:-1] if any(len(k) == len(c) for k in ks) else c
    return {i: full[o] for i, o in inst.items()}


def _reachable(eqns, start: int, downstream: dict, limit: int = 64) -> list[int]:
    """Equations that read `start`'s results, directly or not (at most `limit`)."""
    seen: list[int] = []
    frontier = [start]
    visited = {start}
    while frontier and len(seen) < limit:
        i = frontier.pop(0)
        for o in eqns[i].outvars:
            for j in downstream.get(o, ()):
                if j not in visited:
                    visited.add(j)
                    seen.append(j)
                    frontier.append(j)
    return seen


def _related(eqn, relation: str, readers: dict, producer: dict):
    if relation == "sibling":
        for a in eqn.invars:
            if isinstance(a, jcore.Var) and not is_tiny(a):
                yield from readers.get(a, ())
    elif relation == "consumer":
        for o in eqn.outvars:
            yield from readers.get(o, ())
    else:
        for a in eqn.invars:
            if isinstance(a, jcore.Var) and a in producer:
                yield producer[a]
