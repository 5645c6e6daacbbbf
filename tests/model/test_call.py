"""General inputs of a cached call: a CacheCall's slots, positions and visibility, and move_cache.

model/ knows nothing of trees; these tests are where a tree is built from those general
inputs (a CacheCall spelled out by hand), to show that they are enough. A tree of T nodes
after a cached prefix of P tokens goes into ONE call: node i is written to slot P+i, is
rotated as position P + depth(i) (its position in the sequence its path spells), and sees
exactly its ancestors and itself (plus the prefix, which every new token sees). Then every
node must get the logits that a plain no-cache forward over prefix + its path gives at the
path's end, to 1e-10 in float64. move_cache then moves one path to slots P, P+1, ..., after
which a normal cached call (model.call.chain) continues it as if the path had been
fed alone. model.call.tree, the builder the loops use, is held to the same standard.

Nodes are laid out in the call in a random order (a parent may come after its child), so
nothing here relies on the layout a caller would choose; that also makes move_cache's
sources and destinations overlap both ways.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model import Llama, ModelConfig
from model import call as calls
from model.call import CacheCall
from model.fast.fuse import fuse_projections
from model.fast.prepack import prepack_linears, prepack_supported
from model.feature_head import FeatureHead
from speculative.verify.tree import TokenTree
from tests.support.hf import randomize_
from tests.support.toy_models import random_llama

EXACT = 1e-10  # float64


# ----------------------------------------------------------------------------- trees
@st.composite
def trees(draw: st.DrawFn, max_nodes: int = 8) -> list[int]:
    """parents[i] for the nodes of a random tree in call order, -1 for a child of the prefix.

    Drawn with parents before children, then relabelled by a random permutation."""
    n = draw(st.integers(1, max_nodes))
    topo_parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    order = draw(st.permutations(range(n)))  # call slot s holds node order[s]
    where = {node: slot for slot, node in enumerate(order)}
    return [-1 if topo_parents[node] < 0 else where[topo_parents[node]] for node in order]


def path(parents: list[int], i: int) -> list[int]:
    """The nodes from the top of the tree down to node i, i included."""
    nodes = [i]
    while parents[nodes[-1]] >= 0:
        nodes.append(parents[nodes[-1]])
    return nodes[::-1]


def tree_mask(parents: list[int]) -> torch.Tensor:
    """mask[i, j]: node j is node i or one of its ancestors."""
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i in range(len(parents)):
        mask[i, path(parents, i)] = True
    return mask


def depths(parents: list[int]) -> torch.Tensor:
    return torch.tensor([len(path(parents, i)) - 1 for i in range(len(parents))])


# A fixed tree with siblings at two depths, laid out breadth first: 0 and 1 under the
# prefix, 2 and 3 under 0, 4 under 1, 5 under 3.
BRANCHY = [-1, -1, 0, 0, 1, 3]


# ----------------------------------------------------------------------------- models
@functools.cache
def variant(name: str) -> Llama:
    """The small float64 model with grouped-query heads, or a decoding rewrite of a model:
    stacked projections (model/fast/fuse.py) in float64, prepacked ones (model/fast/prepack.py) in
    float32 on a model large enough for its layers to pass prepacking's size threshold."""
    if name in ("plain", "stacked"):
        model = random_llama(
            vocab=16,
            dim=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            hidden_dim=48,
            max_seq_len=32,
            seed=3,
            dtype=torch.float64,
        )
        if name == "stacked":
            assert fuse_projections(model) == 2 * model.config.n_layers
        return model
    if not prepack_supported():
        pytest.skip("this PyTorch build lacks the oneDNN prepacking operators")
    config = ModelConfig(
        dim=384,
        n_layers=2,
        n_heads=6,
        n_kv_heads=2,
        vocab_size=512,
        hidden_dim=1024,
        max_seq_len=32,
    )
    model = randomize_(Llama(config), seed=0, std=0.08).eval()
    if name == "stacked+prepacked":
        assert fuse_projections(model) == 2 * config.n_layers
    assert prepack_linears(model) > 0
    return model


VARIANTS = ["plain", "stacked", "prepacked", "stacked+prepacked"]


def tolerance(model: torch.nn.Module) -> float:
    # float32: a cached call and a plain forward sum in different orders (as in tests/model/fast/test_prepack.py)
    return EXACT if model.dtype == torch.float64 else 1e-4


@functools.cache
def head() -> FeatureHead:
    """A feature head with grouped-query heads and random weights of order one (as random_llama's)."""
    config = ModelConfig(
        vocab_size=16, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=32
    )
    net = FeatureHead(config)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in net.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
            param.copy_(1 + 0.1 * noise if name.endswith("layernorm.weight") else 0.3 * noise)
    return net.to(torch.float64).eval()


def random_tokens(model: Llama, batch: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=gen)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def node_call(
    batch: int, prefix_len: int, positions: torch.Tensor, mask: torch.Tensor
) -> CacheCall:
    """T new tokens at slots P..P+T-1 of each of ``batch`` rows, rotated as ``positions`` [T],
    each seeing the P cached slots and the new tokens that ``mask`` [T, T] allows: a CacheCall
    spelled out by hand, not by model.call."""
    T = mask.shape[0]
    slots = torch.arange(prefix_len, prefix_len + T).repeat(batch, 1)
    visible = torch.cat([torch.ones(T, prefix_len, dtype=torch.bool), mask], dim=1).repeat(
        batch, 1, 1
    )
    top = max(prefix_len + T - 1, int(positions.max()))
    return CacheCall(slots, positions.repeat(batch, 1), visible, prefix_len + T, top)


def tree_call(
    model: Llama,
    parents: list[int],
    prefix_len: int,
    seed: int,
    batch: int = 2,
    positions: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
):
    """Prefill a random prefix, then one call on a random tree's nodes (depth positions and the
    tree mask unless told otherwise). Returns (tokens [B, P+T], the tree call's logits)."""
    T = len(parents)
    tokens = random_tokens(model, batch, prefix_len + T, seed)
    model.setup_cache(batch, prefix_len + T + 2)
    positions = prefix_len + depths(parents) if positions is None else positions
    mask = tree_mask(parents) if mask is None else mask
    with torch.inference_mode():
        if prefix_len:
            model(tokens[:, :prefix_len], calls.chain(0, prefix_len, model.device, rows=batch))
        logits = model(tokens[:, prefix_len:], node_call(batch, prefix_len, positions, mask))
    return tokens, logits


def worst_node(
    model: Llama, parents: list[int], prefix_len: int, tokens: torch.Tensor, logits: torch.Tensor
) -> float:
    """The largest difference, over nodes, from a plain forward over prefix + the node's path."""
    worst = 0.0
    with torch.inference_mode():
        for i in range(len(parents)):
            sequence = torch.cat(
                [tokens[:, :prefix_len], tokens[:, prefix_len:][:, path(parents, i)]], dim=1
            )
            worst = max(worst, max_diff(logits[:, i], model(sequence)[:, -1]))
    return worst


def keep_path(net: Llama | FeatureHead, batch: int, prefix_len: int, kept: list[int]) -> None:
    """move_cache: in each of the ``batch`` rows, the nodes ``kept`` (call order, slots P + i)
    moved to slots P, P+1, ..."""
    src = [prefix_len + i for i in kept]
    dst = list(range(prefix_len, prefix_len + len(kept)))
    net.move_cache(list(range(batch)), [src] * batch, [dst] * batch)


# ----------------------------------------------------------------------------- (a) defaults
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("seq", [1, 2, 5])
def test_explicit_chain_positions_and_causal_visibility_equal_the_chain_call_bit_for_bit(
    name: str, seq: int
) -> None:
    """calls.chain against the same call spelled out: positions given or defaulted to the slots,
    causal visibility given or defaulted, and for one token no mask at all."""
    model = variant(name)
    prefix_len = 7
    tokens = random_tokens(model, 2, prefix_len + seq, seed=seq)
    new = tokens[:, prefix_len:]
    slots = torch.arange(prefix_len, prefix_len + seq).repeat(2, 1)
    # positions, a tensor of its own
    chain = torch.arange(prefix_len, prefix_len + seq).repeat(2, 1)
    causal = (
        torch.ones(seq, prefix_len + seq, dtype=torch.bool)
        .tril(diagonal=prefix_len)
        .repeat(2, 1, 1)
    )
    window, top = prefix_len + seq, prefix_len + seq - 1
    spelled_out = {
        "positions and visible": CacheCall(slots, chain, causal, window, top),
        "defaults": CacheCall.of(slots),
        "positions only": CacheCall.of(slots, positions=chain),
        "visible only": CacheCall.of(slots, visible=causal),
    }
    if seq == 1:
        spelled_out["nothing masked"] = CacheCall(slots, chain, None, window, top)
    model.setup_cache(2, prefix_len + seq)
    with torch.inference_mode():
        model(tokens[:, :prefix_len], calls.chain(0, prefix_len, model.device, rows=2))
        expected = model(new, calls.chain(prefix_len, seq, model.device, rows=2))
        assert expected.abs().max() > 1.0  # logits are not flat, so equality means something
        for what, call in spelled_out.items():
            assert torch.equal(model(new, call), expected), what


# ----------------------------------------------------------------------------- (b) trees
@pytest.mark.parametrize("name", VARIANTS)
@settings(max_examples=30, derandomize=True, deadline=None)
@given(parents=trees(), prefix_len=st.integers(0, 6), seed=st.integers(0, 2**16))
def test_a_tree_call_gives_every_node_the_logits_of_its_path(
    name: str, parents: list[int], prefix_len: int, seed: int
) -> None:
    model = variant(name)
    tokens, logits = tree_call(model, parents, prefix_len, seed)
    assert logits.shape == (2, len(parents), model.config.vocab_size)
    diff = worst_node(model, parents, prefix_len, tokens, logits)
    assert diff <= tolerance(model), f"{name}: {diff:.3g}"


@pytest.mark.parametrize("name", ["plain", "prepacked"])
def test_the_tree_check_sees_chain_positions_and_a_causal_mask(name: str) -> None:
    """Mutants: giving the nodes their slots' positions (a chain's) instead of their depths, or
    causal visibility instead of the tree mask, moves some node's logits far beyond the tolerance."""
    model = variant(name)
    prefix_len, T = 4, len(BRANCHY)
    tokens, logits = tree_call(model, BRANCHY, prefix_len, seed=5)
    assert worst_node(model, BRANCHY, prefix_len, tokens, logits) <= tolerance(model)
    chain = torch.arange(prefix_len, prefix_len + T)
    tokens, logits = tree_call(model, BRANCHY, prefix_len, seed=5, positions=chain)
    assert worst_node(model, BRANCHY, prefix_len, tokens, logits) > 1e-3
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    tokens, logits = tree_call(model, BRANCHY, prefix_len, seed=5, mask=causal)
    assert worst_node(model, BRANCHY, prefix_len, tokens, logits) > 1e-3


@st.composite
def ordered_trees(draw: st.DrawFn, max_nodes: int = 8) -> list[int]:
    """parents[i] of a random tree whose parents come before their children (a TokenTree's order)."""
    return [draw(st.integers(-1, i - 1)) for i in range(draw(st.integers(1, max_nodes)))]


@settings(max_examples=40, derandomize=True, deadline=None)
@given(
    parents=ordered_trees(),
    cached=st.integers(0, 4),
    prefix=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_calls_tree_gives_its_chain_tokens_and_every_node_the_logits_of_their_sequences(
    parents: list[int], cached: int, prefix: int, seed: int
) -> None:
    """The builder the loops use: after ``cached`` tokens in the cache, calls.tree(cached, prefix,
    tree) places ``prefix`` chain tokens (the last one the root, or the last cached token when
    there are none) and then the tree's nodes. Every chain token gets the logits of the sequence
    up to it, every node those of the sequence up to the root followed by its path."""
    if cached + prefix == 0:
        cached = 1  # the root must be somewhere
    model, T = variant("plain"), len(parents)
    tokens = random_tokens(model, 1, cached + prefix + T, seed)
    tree = TokenTree(tokens=tokens[0, cached + prefix :], parents=parents, mode="deterministic")
    model.setup_cache(1, cached + prefix + T)
    with torch.inference_mode():
        if cached:
            model(tokens[:, :cached], calls.chain(0, cached, model.device))
        logits = model(tokens[:, cached:], calls.tree(cached, prefix, tree, model.device))
        assert logits.shape == (1, prefix + T, model.config.vocab_size)
        root = cached + prefix  # tokens[:, :root] is the sequence up to the root
        for i in range(prefix):
            assert max_diff(logits[:, i], model(tokens[:, : cached + i + 1])[:, -1]) <= EXACT
        for i in range(T):
            sequence = torch.cat([tokens[:, :root], tokens[:, root:][:, path(parents, i)]], dim=1)
            assert max_diff(logits[:, prefix + i], model(sequence)[:, -1]) <= EXACT


# ----------------------------------------------------------------------------- (c) move_cache
@settings(max_examples=40, derandomize=True, deadline=None)
@given(
    parents=trees(),
    prefix_len=st.integers(0, 6),
    seed=st.integers(0, 2**16),
    pick=st.integers(0, 7),
    extra=st.integers(1, 2),
)
def test_move_cache_moves_a_path_into_place(
    parents: list[int], prefix_len: int, seed: int, pick: int, extra: int
) -> None:
    """After a tree call, keep one node's path at slots P.. and continue with `extra` new tokens
    by an ordinary cached call: the logits of a plain forward over prefix + path + those tokens."""
    model = variant("plain")
    tokens, _ = tree_call(model, parents, prefix_len, seed)
    kept = path(parents, pick % len(parents))
    following = random_tokens(model, 2, extra, seed + 1)
    keep_path(model, 2, prefix_len, kept)
    sequence = torch.cat(
        [tokens[:, :prefix_len], tokens[:, prefix_len:][:, kept], following], dim=1
    )
    with torch.inference_mode():
        got = model(following, calls.chain(prefix_len + len(kept), extra, model.device, rows=2))
        expected = model(sequence)[:, -extra:]
    assert max_diff(got, expected) <= EXACT


def test_the_keep_check_sees_a_path_left_where_it_was() -> None:
    """Mutant: skipping move_cache (the path's nodes left at their call slots) is caught."""
    model = variant("plain")
    prefix_len, kept = 4, path(BRANCHY, 5)  # nodes 0, 3, 5: not at slots P, P+1, P+2
    following = random_tokens(model, 2, 1, seed=7)
    for keep in (False, True):  # a fresh tree call each time: the continuation overwrites slot P+3
        tokens, _ = tree_call(model, BRANCHY, prefix_len, seed=6)
        sequence = torch.cat(
            [tokens[:, :prefix_len], tokens[:, prefix_len:][:, kept], following], dim=1
        )
        if keep:
            keep_path(model, 2, prefix_len, kept)
        with torch.inference_mode():
            got = model(following, calls.chain(prefix_len + len(kept), 1, model.device, rows=2))
            diff = max_diff(got, model(sequence)[:, -1:])
        assert diff <= EXACT if keep else diff > 1e-3


@settings(max_examples=60, derandomize=True, deadline=None)
@given(slots=st.lists(st.integers(0, 11), max_size=12), dst=st.integers(0, 12))
def test_move_cache_gathers_before_it_writes(slots: list[int], dst: int) -> None:
    """Every layer's slot dst+i of both rows ends up holding what slot slots[i] held before the
    call, whatever the overlap; every other slot (the scratch slot included) is untouched."""
    model = variant("plain")
    model.setup_cache(2, 12)
    gen = torch.Generator().manual_seed(len(slots) + 13 * dst)
    for layer in model.layers:
        for buffer in (layer.self_attn.cache.k, layer.self_attn.cache.v):
            buffer.copy_(torch.randn(buffer.shape, generator=gen, dtype=buffer.dtype))
    before = [
        (layer.self_attn.cache.k.clone(), layer.self_attn.cache.v.clone()) for layer in model.layers
    ]
    destinations = list(range(dst, dst + len(slots)))
    if dst + len(slots) > 12:
        with pytest.raises(ValueError, match=r"must be ints in 0\.\.11"):
            model.move_cache([0, 1], [slots, slots], [destinations, destinations])
        for layer, (k, v) in zip(model.layers, before):  # refused before anything moved
            assert torch.equal(layer.self_attn.cache.k, k) and torch.equal(
                layer.self_attn.cache.v, v
            )
        return
    model.move_cache([0, 1], [slots, slots], [destinations, destinations])
    for layer, (k, v) in zip(model.layers, before):
        for old, new in ((k, layer.self_attn.cache.k), (v, layer.self_attn.cache.v)):
            expected = old.clone()
            for i, slot in enumerate(slots):
                expected[:, :, dst + i] = old[:, :, slot]
            assert torch.equal(new, expected)


def test_the_gather_check_sees_a_copy_slot_by_slot() -> None:
    """Mutant: copying one slot at a time in place reads a slot it has already overwritten when a
    source lies after its destination: [3, 4] -> 4, 5 would copy slot 3 twice."""
    cache = torch.randn(1, 1, 8, 2, generator=torch.Generator().manual_seed(0))
    one_by_one = cache.clone()
    for i, slot in enumerate([3, 4]):
        one_by_one[:, :, 4 + i] = one_by_one[:, :, slot]
    assert torch.equal(one_by_one[:, :, 5], cache[:, :, 3])  # not slot 4's old entry: wrong


# ----------------------------------------------------------------------------- (d) FeatureHead
def head_inputs(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, length, head().config.dim)
    return (
        torch.randn(shape, generator=gen, dtype=torch.float64),
        torch.randn(shape, generator=gen, dtype=torch.float64),
    )


@settings(max_examples=30, derandomize=True, deadline=None)
@given(
    parents=trees(),
    prefix_len=st.integers(0, 6),
    seed=st.integers(0, 2**16),
    pick=st.integers(0, 7),
)
def test_feature_head_tree_call_and_move_cache(
    parents: list[int], prefix_len: int, seed: int, pick: int
) -> None:
    """The head's tree call gives every node the output of a plain forward over prefix + its path;
    after move_cache a cached call continues one path as if it had been fed alone."""
    net, T = head(), len(parents)
    features, embeddings = head_inputs(2, prefix_len + T + 1, seed)
    net.setup_cache(2, prefix_len + T + 1)

    def rows(x: torch.Tensor, nodes: list[int]) -> torch.Tensor:  # prefix + the given nodes
        return torch.cat([x[:, :prefix_len], x[:, prefix_len : prefix_len + T][:, nodes]], dim=1)

    with torch.inference_mode():
        if prefix_len:
            net(
                features[:, :prefix_len],
                embeddings[:, :prefix_len],
                calls.chain(0, prefix_len, net.device, rows=2),
            )
        got = net(
            features[:, prefix_len:-1],
            embeddings[:, prefix_len:-1],
            node_call(2, prefix_len, prefix_len + depths(parents), tree_mask(parents)),
        )
        for i in range(T):
            nodes = path(parents, i)
            assert (
                max_diff(got[:, i], net(rows(features, nodes), rows(embeddings, nodes))[:, -1])
                <= EXACT
            )
        kept = path(parents, pick % T)
        keep_path(net, 2, prefix_len, kept)
        last_f, last_e = features[:, -1:], embeddings[:, -1:]
        continued = net(last_f, last_e, calls.chain(prefix_len + len(kept), 1, net.device, rows=2))
        expected = net(
            torch.cat([rows(features, kept), last_f], dim=1),
            torch.cat([rows(embeddings, kept), last_e], dim=1),
        )[:, -1:]
    assert max_diff(continued, expected) <= EXACT


def test_feature_head_tree_check_sees_chain_positions() -> None:
    net, prefix_len, T = head(), 3, len(BRANCHY)
    features, embeddings = head_inputs(1, prefix_len + T, seed=2)
    net.setup_cache(1, prefix_len + T)
    with torch.inference_mode():
        net(
            features[:, :prefix_len],
            embeddings[:, :prefix_len],
            calls.chain(0, prefix_len, net.device),
        )
        new_f, new_e = features[:, prefix_len:], embeddings[:, prefix_len:]
        right = net(
            new_f, new_e, node_call(1, prefix_len, prefix_len + depths(BRANCHY), tree_mask(BRANCHY))
        )
        chain = net(
            new_f,
            new_e,
            node_call(1, prefix_len, torch.arange(prefix_len, prefix_len + T), tree_mask(BRANCHY)),
        )
        nodes = path(BRANCHY, 5)
        expected = net(
            torch.cat([features[:, :prefix_len], new_f[:, nodes]], dim=1),
            torch.cat([embeddings[:, :prefix_len], new_e[:, nodes]], dim=1),
        )[:, -1]
    assert max_diff(right[:, 5], expected) <= EXACT
    assert max_diff(chain[:, 5], expected) > 1e-3


# ----------------------------------------------------------------------------- (e) bad inputs
def test_a_token_that_sees_no_new_token_sees_the_cached_prefix() -> None:
    """Allowed after a prefix (the token attends the cache only); a token that sees no slot at
    all (here at the start of the cache) is an error."""
    model = variant("plain")
    tokens = random_tokens(model, 1, 6, seed=3)
    model.setup_cache(1, 8)
    slots = torch.tensor([[4, 5]])
    nothing_new = torch.tensor([[[True] * 4 + [False, False], [True] * 6]])
    nothing_at_all = torch.tensor([[[False, False], [True, True]]])
    with torch.inference_mode():
        model(tokens[:, :4], calls.chain(0, 4, model.device))
        got = model(tokens[:, 4:], CacheCall(slots, slots, nothing_new, 6, 5))
        assert torch.isfinite(got).all()
        with pytest.raises(ValueError, match="see at least one slot"):
            model(tokens[:, :2], CacheCall.of(torch.tensor([[0, 1]]), visible=nothing_at_all))


# Two tokens at slots 4 and 5 of a cache of 8 (slot 8 is the scratch slot, 9 lies past it).
SLOTS = torch.tensor([[4, 5]])
SEE = torch.tensor([[[True] * 5 + [False], [True] * 6]])  # causal, window 6
LONG_SHAPE = r"positions must be a LongTensor of the slots' shape \(1, 2\)"
BOOL_SHAPE = r"visible must be a BoolTensor \(1, 2, 6\) \(rows, tokens, window\)"
BAD_CALLS = {
    "positions [1, 3]": (
        lambda: CacheCall(SLOTS, torch.tensor([[4, 5, 6]]), SEE, 6, 6),
        LONG_SHAPE,
    ),
    "positions [T]": (lambda: CacheCall(SLOTS, torch.tensor([4, 5]), SEE, 6, 5), LONG_SHAPE),
    "positions [2, 2]": (
        lambda: CacheCall(SLOTS, torch.tensor([[4, 5], [4, 5]]), SEE, 6, 5),
        LONG_SHAPE,
    ),
    "positions float": (
        lambda: CacheCall(SLOTS, torch.tensor([[4.0, 5.0]]), SEE, 6, 5),
        LONG_SHAPE,
    ),
    "positions list": (lambda: CacheCall(SLOTS, [[4, 5]], SEE, 6, 5), LONG_SHAPE),
    "position -1": (lambda: CacheCall.of(SLOTS, torch.tensor([[4, -1]])), r"must be >= 0, got -1"),
    "position 9": (
        lambda: CacheCall.of(SLOTS, torch.tensor([[4, 9]])),
        r"up to 9 fall outside the KV cache",
    ),
    "slot 9": (lambda: CacheCall.of(torch.tensor([[4, 9]])), r"up to 9 fall outside the KV cache"),
    "slots float": (
        lambda: CacheCall(SLOTS.double(), SLOTS, SEE, 6, 5),
        r"slots must be a LongTensor \[B, T\]",
    ),
    "slots [T]": (
        lambda: CacheCall(SLOTS[0], SLOTS[0], None, 6, 5),
        r"slots must be a LongTensor \[B, T\]",
    ),
    "slots for 3 tokens": (
        lambda: CacheCall.of(torch.tensor([[4, 5, 6]])),
        r"the call places \(1, 3\) tokens, the input has \(1, 2\)",
    ),
    "window 0": (lambda: CacheCall(SLOTS, SLOTS, None, 0, 5), "reads at least one slot"),
    "window 9": (
        lambda: CacheCall(SLOTS, SLOTS, torch.ones(1, 2, 9, dtype=torch.bool), 9, 5),
        r"up to 8 fall outside the KV cache",
    ),
    "visible [1, 2, 5]": (lambda: CacheCall(SLOTS, SLOTS, SEE[:, :, :5], 6, 5), BOOL_SHAPE),
    "visible [2, 6]": (lambda: CacheCall(SLOTS, SLOTS, SEE[0], 6, 5), BOOL_SHAPE),
    "visible float": (lambda: CacheCall(SLOTS, SLOTS, SEE.double(), 6, 5), BOOL_SHAPE),
    "visible long": (lambda: CacheCall(SLOTS, SLOTS, SEE.long(), 6, 5), BOOL_SHAPE),
    "visible list": (lambda: CacheCall(SLOTS, SLOTS, SEE.tolist(), 6, 5), BOOL_SHAPE),
}


@pytest.mark.parametrize("bad", list(BAD_CALLS))
def test_bad_calls_raise_one_clear_error(bad: str) -> None:
    """Building or making the call raises one ValueError, for the model and the feature head."""
    make, message = BAD_CALLS[bad]
    model = variant("plain")
    model.setup_cache(1, 8)
    tokens = random_tokens(model, 1, 2, seed=0)
    with pytest.raises(ValueError, match=message), torch.inference_mode():
        model(tokens, make())
    features, embeddings = head_inputs(1, 2, seed=0)
    head().setup_cache(1, 8)
    with pytest.raises(ValueError, match=message), torch.inference_mode():
        head()(features, embeddings, make())


def test_a_cached_call_needs_a_cache_and_a_cache_call() -> None:
    """A CacheCall before setup_cache is refused; so is anything else in its place (positions,
    a start slot), once there is a cache."""
    llama, net = random_llama(max_seq_len=8), FeatureHead(head().config)  # fresh: no cache yet
    tokens, inputs = random_tokens(llama, 1, 2, seed=0), head_inputs(1, 2, seed=0)
    for forward, args in ((llama, (tokens,)), (net, tuple(x.to(net.dtype) for x in inputs))):
        with (
            pytest.raises(RuntimeError, match=r"needs setup_cache\(...\) first"),
            torch.inference_mode(),
        ):
            forward(*args, calls.chain(4, 2, "cpu"))
        forward.setup_cache(1, 8)
        for not_a_call in (torch.arange(4, 6), 4):
            with (
                pytest.raises(TypeError, match="a cached call takes a CacheCall"),
                torch.inference_mode(),
            ):
                forward(*args, not_a_call)


@pytest.mark.parametrize(
    "rows, src, dst, message",
    [
        ([0], [[0, 8]], [[0, 1]], r"must be ints in 0\.\.7, got \[\[0, 8\]\]"),
        ([0], [[-1]], [[0]], r"must be ints in 0\.\.7, got \[\[-1\]\]"),
        ([0], [[0, 1]], [[7, 8]], r"must be ints in 0\.\.7, got \[\[7, 8\]\]"),
        ([0], [[0]], [[-1]], r"must be ints in 0\.\.7, got \[\[-1\]\]"),
        ([0], [[1.0]], [[0]], r"must be ints in 0\.\.7, got \[\[1\.0\]\]"),
        ([0], [[[0, 1]]], [[[2, 3]]], r"must be ints in 0\.\.7, got \[\[\[0, 1\]\]\]"),
        ([0], [0, 1], [2, 3], "src and dst go together"),  # one row's slots not wrapped in a list
        ([0], [1], [2], "src and dst go together"),
        ([0], [[0, 1]], [[2]], "src and dst go together"),
        ([0], [[0]], None, "src and dst go together"),
        ([0], None, [[0]], "src and dst go together"),
        ([0], [[0], [1]], [[2], [3]], "src and dst go together"),  # two lists for one row
        ([1], None, None, r"rows to keep must be ints in 0\.\.0, got \[1\]"),
        ([-1], [[0]], [[1]], r"rows to keep must be ints in 0\.\.0, got \[-1\]"),
    ],
)
def test_bad_move_cache_raises(rows: list, src, dst, message: str) -> None:
    for net in (random_llama(max_seq_len=8), FeatureHead(head().config)):  # fresh: no cache yet
        with pytest.raises(RuntimeError, match=r"move_cache\(...\) needs setup_cache"):
            net.move_cache([0], [[0]], [[1]])
        net.setup_cache(1, 8)
        with pytest.raises(ValueError, match=message):
            net.move_cache(rows, src, dst)
