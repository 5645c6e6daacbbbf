"""General inputs of a cached call: explicit positions, a mask among the new tokens, and keep_cache.

model/ knows nothing of trees; these tests are where a tree is built from those general
inputs, to show that they are enough. A tree of T nodes after a cached prefix of P tokens
goes into ONE call at start_pos P: node i is written to slot P+i, is rotated as position
P + depth(i) (its position in the sequence its path spells), and sees exactly its ancestors
and itself (plus the prefix, which every new token sees). Then every node must get the
logits that a plain no-cache forward over prefix + its path gives at the path's end, to
1e-10 in float64. keep_cache then moves one path to slots P, P+1, ..., after which a normal
cached call continues it as if the path had been fed alone.

Nodes are laid out in the call in a random order (a parent may come after its child), so
nothing here relies on the layout a caller would choose; that also makes keep_cache's
sources and destinations overlap both ways.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import randomize_
from hypothesis import given, settings
from hypothesis import strategies as st
from toy_models import random_llama

from model import Llama, ModelConfig
from model.feature_head import FeatureHead
from model.fuse import fuse_projections
from model.prepack import prepack_linears, prepack_supported

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
    stacked projections (model/fuse.py) in float64, prepacked ones (model/prepack.py) in
    float32 on a model large enough for its layers to pass prepacking's size threshold."""
    if name in ("plain", "stacked"):
        model = random_llama(vocab=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48,
                             max_seq_len=32, seed=3, dtype=torch.float64)
        if name == "stacked":
            assert fuse_projections(model) == 2 * model.config.n_layers
        return model
    if not prepack_supported():
        pytest.skip("this PyTorch build lacks the oneDNN prepacking operators")
    config = ModelConfig(dim=384, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=512, hidden_dim=1024,
                         max_seq_len=32)
    model = randomize_(Llama(config), seed=0, std=0.08).eval()
    if name == "stacked+prepacked":
        assert fuse_projections(model) == 2 * config.n_layers
    assert prepack_linears(model) > 0
    return model


VARIANTS = ["plain", "stacked", "prepacked", "stacked+prepacked"]


def tolerance(model: torch.nn.Module) -> float:
    # float32: a cached call and a plain forward sum in different orders (as in test_prepack.py)
    return EXACT if model.dtype == torch.float64 else 1e-4


@functools.cache
def head() -> FeatureHead:
    """A feature head with grouped-query heads and random weights of order one (as random_llama's)."""
    config = ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=32)
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


def tree_call(model: Llama, parents: list[int], prefix_len: int, seed: int, batch: int = 2,
              positions: torch.Tensor | None = None, mask: torch.Tensor | None = None):
    """Prefill a random prefix, then one call on a random tree's nodes (depth positions and the
    tree mask unless told otherwise). Returns (tokens [B, P+T], the tree call's logits)."""
    T = len(parents)
    tokens = random_tokens(model, batch, prefix_len + T, seed)
    model.setup_cache(batch, prefix_len + T + 2)
    positions = prefix_len + depths(parents) if positions is None else positions
    mask = tree_mask(parents) if mask is None else mask
    with torch.inference_mode():
        if prefix_len:
            model(tokens[:, :prefix_len], start_pos=0)
        logits = model(tokens[:, prefix_len:], start_pos=prefix_len, positions=positions, mask=mask)
    return tokens, logits


def worst_node(model: Llama, parents: list[int], prefix_len: int, tokens: torch.Tensor,
               logits: torch.Tensor) -> float:
    """The largest difference, over nodes, from a plain forward over prefix + the node's path."""
    worst = 0.0
    with torch.inference_mode():
        for i in range(len(parents)):
            sequence = torch.cat([tokens[:, :prefix_len], tokens[:, prefix_len:][:, path(parents, i)]], dim=1)
            worst = max(worst, max_diff(logits[:, i], model(sequence)[:, -1]))
    return worst


# ----------------------------------------------------------------------------- (a) defaults
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("seq", [1, 2, 5])
def test_explicit_chain_positions_and_causal_mask_equal_the_default_call_bit_for_bit(name: str, seq: int) -> None:
    model = variant(name)
    prefix_len = 7
    tokens = random_tokens(model, 2, prefix_len + seq, seed=seq)
    new = tokens[:, prefix_len:]
    chain = torch.arange(prefix_len, prefix_len + seq)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    model.setup_cache(2, prefix_len + seq)
    with torch.inference_mode():
        model(tokens[:, :prefix_len], start_pos=0)
        expected = model(new, start_pos=prefix_len)
        assert expected.abs().max() > 1.0  # logits are not flat, so equality means something
        for positions, mask in ((chain, None), (None, causal), (chain, causal), (chain.tolist(), causal)):
            got = model(new, start_pos=prefix_len, positions=positions, mask=mask)
            assert torch.equal(got, expected), (positions is None, mask is None)


# ----------------------------------------------------------------------------- (b) trees
@pytest.mark.parametrize("name", VARIANTS)
@settings(max_examples=30, derandomize=True, deadline=None)
@given(parents=trees(), prefix_len=st.integers(0, 6), seed=st.integers(0, 2**16))
def test_a_tree_call_gives_every_node_the_logits_of_its_path(name: str, parents: list[int], prefix_len: int,
                                                             seed: int) -> None:
    model = variant(name)
    tokens, logits = tree_call(model, parents, prefix_len, seed)
    assert logits.shape == (2, len(parents), model.config.vocab_size)
    diff = worst_node(model, parents, prefix_len, tokens, logits)
    assert diff <= tolerance(model), f"{name}: {diff:.3g}"


@pytest.mark.parametrize("name", ["plain", "prepacked"])
def test_the_tree_check_sees_chain_positions_and_a_causal_mask(name: str) -> None:
    """Mutants: giving the nodes their slots' positions (a chain's) instead of their depths, or
    the causal mask instead of the tree mask, moves some node's logits far beyond the tolerance."""
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


# ----------------------------------------------------------------------------- (c) keep_cache
@settings(max_examples=40, derandomize=True, deadline=None)
@given(parents=trees(), prefix_len=st.integers(0, 6), seed=st.integers(0, 2**16), pick=st.integers(0, 7),
       extra=st.integers(1, 2))
def test_keep_cache_moves_a_path_into_place(parents: list[int], prefix_len: int, seed: int, pick: int,
                                            extra: int) -> None:
    """After a tree call, keep one node's path at slots P.. and continue with `extra` new tokens
    by an ordinary cached call: the logits of a plain forward over prefix + path + those tokens."""
    model = variant("plain")
    tokens, _ = tree_call(model, parents, prefix_len, seed)
    kept = path(parents, pick % len(parents))
    following = random_tokens(model, 2, extra, seed + 1)
    model.keep_cache(torch.tensor(kept) + prefix_len, prefix_len)
    sequence = torch.cat([tokens[:, :prefix_len], tokens[:, prefix_len:][:, kept], following], dim=1)
    with torch.inference_mode():
        got = model(following, start_pos=prefix_len + len(kept))
        expected = model(sequence)[:, -extra:]
    assert max_diff(got, expected) <= EXACT


def test_the_keep_check_sees_a_path_left_where_it_was() -> None:
    """Mutant: without keep_cache the continuation reads the tree's slots in layout order."""
    model = variant("plain")
    prefix_len, kept = 4, path(BRANCHY, 5)  # nodes 0, 3, 5: not at slots P, P+1, P+2
    following = random_tokens(model, 2, 1, seed=7)
    for keep in (False, True):  # a fresh tree call each time: the continuation overwrites slot P+3
        tokens, _ = tree_call(model, BRANCHY, prefix_len, seed=6)
        sequence = torch.cat([tokens[:, :prefix_len], tokens[:, prefix_len:][:, kept], following], dim=1)
        if keep:
            model.keep_cache([prefix_len + i for i in kept], prefix_len)
        with torch.inference_mode():
            diff = max_diff(model(following, start_pos=prefix_len + len(kept)), model(sequence)[:, -1:])
        assert diff <= EXACT if keep else diff > 1e-3


@settings(max_examples=60, derandomize=True, deadline=None)
@given(slots=st.lists(st.integers(0, 11), max_size=12), dst=st.integers(0, 12))
def test_keep_cache_gathers_before_it_writes(slots: list[int], dst: int) -> None:
    """Every layer's slot dst+i ends up holding what slot slots[i] held before the call, whatever
    the overlap; every other slot is untouched."""
    model = variant("plain")
    model.setup_cache(2, 12)
    gen = torch.Generator().manual_seed(len(slots) + 13 * dst)
    for layer in model.layers:
        for buffer in (layer.self_attn.cache.k, layer.self_attn.cache.v):
            buffer.copy_(torch.randn(buffer.shape, generator=gen, dtype=buffer.dtype))
    before = [(layer.self_attn.cache.k.clone(), layer.self_attn.cache.v.clone()) for layer in model.layers]
    if dst + len(slots) > 12:
        with pytest.raises(ValueError, match="outside the KV cache"):
            model.keep_cache(slots, dst)
        return
    model.keep_cache(slots, dst)
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
    return (torch.randn(shape, generator=gen, dtype=torch.float64),
            torch.randn(shape, generator=gen, dtype=torch.float64))


@settings(max_examples=30, derandomize=True, deadline=None)
@given(parents=trees(), prefix_len=st.integers(0, 6), seed=st.integers(0, 2**16), pick=st.integers(0, 7))
def test_feature_head_tree_call_and_keep_cache(parents: list[int], prefix_len: int, seed: int, pick: int) -> None:
    """The head's tree call gives every node the output of a plain forward over prefix + its path;
    after keep_cache a cached call continues one path as if it had been fed alone."""
    net, T = head(), len(parents)
    features, embeddings = head_inputs(2, prefix_len + T + 1, seed)
    net.setup_cache(2, prefix_len + T + 1)

    def rows(x: torch.Tensor, nodes: list[int]) -> torch.Tensor:  # prefix + the given nodes
        return torch.cat([x[:, :prefix_len], x[:, prefix_len:prefix_len + T][:, nodes]], dim=1)

    with torch.inference_mode():
        if prefix_len:
            net(features[:, :prefix_len], embeddings[:, :prefix_len], start_pos=0)
        got = net(features[:, prefix_len:-1], embeddings[:, prefix_len:-1], start_pos=prefix_len,
                  positions=prefix_len + depths(parents), mask=tree_mask(parents))
        for i in range(T):
            nodes = path(parents, i)
            assert max_diff(got[:, i], net(rows(features, nodes), rows(embeddings, nodes))[:, -1]) <= EXACT
        kept = path(parents, pick % T)
        net.keep_cache([prefix_len + i for i in kept], prefix_len)
        last_f, last_e = features[:, -1:], embeddings[:, -1:]
        continued = net(last_f, last_e, start_pos=prefix_len + len(kept))
        expected = net(torch.cat([rows(features, kept), last_f], dim=1),
                       torch.cat([rows(embeddings, kept), last_e], dim=1))[:, -1:]
    assert max_diff(continued, expected) <= EXACT


def test_feature_head_tree_check_sees_chain_positions() -> None:
    net, prefix_len, T = head(), 3, len(BRANCHY)
    features, embeddings = head_inputs(1, prefix_len + T, seed=2)
    net.setup_cache(1, prefix_len + T)
    with torch.inference_mode():
        net(features[:, :prefix_len], embeddings[:, :prefix_len], start_pos=0)
        new_f, new_e = features[:, prefix_len:], embeddings[:, prefix_len:]
        right = net(new_f, new_e, start_pos=prefix_len, positions=prefix_len + depths(BRANCHY),
                    mask=tree_mask(BRANCHY))
        chain = net(new_f, new_e, start_pos=prefix_len, positions=torch.arange(prefix_len, prefix_len + T),
                    mask=tree_mask(BRANCHY))
        nodes = path(BRANCHY, 5)
        expected = net(torch.cat([features[:, :prefix_len], new_f[:, nodes]], dim=1),
                       torch.cat([embeddings[:, :prefix_len], new_e[:, nodes]], dim=1))[:, -1]
    assert max_diff(right[:, 5], expected) <= EXACT
    assert max_diff(chain[:, 5], expected) > 1e-3


# ----------------------------------------------------------------------------- (e) bad inputs
def test_a_row_that_sees_no_new_token_sees_the_cached_prefix() -> None:
    """Allowed after a prefix (the row attends the cache only); at start_pos 0 it is an error."""
    model = variant("plain")
    tokens = random_tokens(model, 1, 6, seed=3)
    model.setup_cache(1, 8)
    nothing_new = torch.tensor([[False, False], [True, True]])
    with torch.inference_mode():
        model(tokens[:, :4], start_pos=0)
        got = model(tokens[:, 4:], start_pos=4, mask=nothing_new)
        assert torch.isfinite(got).all()
        with pytest.raises(ValueError, match="every row of the mask needs a True"):
            model(tokens[:, 4:], start_pos=0, mask=nothing_new)


BAD_CALLS = [
    ({"positions": torch.arange(3)}, "shape"),
    ({"positions": torch.arange(2)[None]}, "shape"),
    ({"positions": torch.tensor([4.0, 5.0])}, "LongTensor"),
    ({"positions": torch.tensor([4, -1])}, "outside the rotary table"),
    ({"positions": torch.tensor([4, 8])}, "outside the rotary table"),
    ({"mask": torch.ones(2, 3, dtype=torch.bool)}, "shape"),
    ({"mask": torch.ones(2, dtype=torch.bool)}, "shape"),
    ({"mask": torch.ones(2, 2)}, "BoolTensor"),
    ({"mask": torch.ones(2, 2, dtype=torch.long)}, "BoolTensor"),
    ({"mask": [[True, False], [True, True]]}, "BoolTensor"),
]


@pytest.mark.parametrize("kwargs, message", BAD_CALLS)
def test_bad_positions_and_masks_raise(kwargs: dict, message: str) -> None:
    model = variant("plain")
    model.setup_cache(1, 8)
    tokens = random_tokens(model, 1, 2, seed=0)
    with pytest.raises(ValueError, match=message), torch.inference_mode():
        model(tokens, start_pos=4, **kwargs)
    features, embeddings = head_inputs(1, 2, seed=0)
    head().setup_cache(1, 8)
    with pytest.raises(ValueError, match=message), torch.inference_mode():
        head()(features, embeddings, start_pos=4, **kwargs)


@pytest.mark.parametrize("kwargs", [{"positions": torch.arange(2)}, {"mask": torch.ones(2, 2, dtype=torch.bool)}])
def test_positions_and_mask_need_a_cached_call(kwargs: dict) -> None:
    tokens = random_tokens(variant("plain"), 1, 2, seed=0)
    with pytest.raises(ValueError, match="pass start_pos"), torch.inference_mode():
        variant("plain")(tokens, **kwargs)
    with pytest.raises(ValueError, match="pass start_pos"), torch.inference_mode():
        head()(*head_inputs(1, 2, seed=0), **kwargs)


@pytest.mark.parametrize("slots, dst, message", [
    ([0, 8], 0, r"slots 0\.\.8 fall outside"),
    ([-1], 0, r"slots -1\.\.-1 fall outside"),
    ([0, 1], 7, "keeping 2 slots at 7"),
    ([0], -1, "keeping 1 slots at -1"),
    (torch.zeros(1, 2, dtype=torch.long), 0, "LongTensor"),
    (torch.tensor([1.0]), 0, "LongTensor"),
])
def test_bad_keep_cache_raises(slots, dst: int, message: str) -> None:
    for net in (random_llama(max_seq_len=8), FeatureHead(head().config)):  # fresh: no cache yet
        with pytest.raises(RuntimeError, match="setup_cache"):
            net.keep_cache([0], 0)
        net.setup_cache(1, 8)
        with pytest.raises(ValueError, match=message):
            net.keep_cache(slots, dst)
