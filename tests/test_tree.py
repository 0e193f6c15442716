"""Static token trees, the tree attention mask, greedy acceptance and the K/V commit."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s3djax.errors import UserError
from s3djax.speculative import tree as trees
from s3djax.speculative.tree import TreeSpec
from s3djax.speculative.verify import commit_path, greedy_accept, tree_mask

# root 0; 1=(0,) 2=(1,) 3=(0,0) 4=(0,1) 5=(1,0) 6=(0,0,0)
SMALL = TreeSpec.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])


def test_derived_structure():
    assert SMALL.num_nodes == 7 and SMALL.depth == 3 and SMALL.max_rank == 1
    assert SMALL.parents.tolist() == [0, 0, 0, 1, 1, 2, 3]
    assert SMALL.node_depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert SMALL.node_ranks.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert np.flatnonzero(SMALL.ancestors[6]).tolist() == [0, 1, 3, 6]
    assert np.flatnonzero(SMALL.ancestors[5]).tolist() == [0, 2, 5]
    assert SMALL.path_table[6].tolist() == [0, 1, 3, 6] and SMALL.path_table[2].tolist() == [0, 2, 2, 2]


def test_chain_and_named_trees():
    assert TreeSpec.chain(3).paths == ((0,), (0, 0), (0, 0, 0))
    for name, size in (("tree-8", 8), ("tree-16", 16), ("tree-32", 32), ("tree-64", 64)):
        tree = trees.resolve(name, 4)
        assert tree.num_nodes == size + 1 and tree.depth == 4


@pytest.mark.parametrize("paths, message", [
    ([(0,), (1, 0)], "no parent"),
    ([(0,), (0,), (0, 0)], None),  # duplicates given to from_paths are merged, not an error
    ([(0,), (-1,)], "ranks >= 0"),
    ([], "no nodes"),
])
def test_validation(paths, message):
    if message is None:
        assert TreeSpec.from_paths(paths).num_nodes == 3
    else:
        with pytest.raises(UserError, match=message):
            TreeSpec.from_paths(paths)


def test_resolve_errors():
    with pytest.raises(UserError, match="unknown tree 'bush'"):
        trees.resolve("bush", 4)
    with pytest.raises(UserError, match="raise --gamma to 4"):
        trees.resolve("tree-16", 2)
    with pytest.raises(UserError, match="gamma >= 1"):
        trees.resolve("chain", 0)


def test_tree_mask_sees_prefix_and_ancestors_only():
    length, s = 5, 16
    mask = np.asarray(tree_mask(jnp.asarray([length]), SMALL.arrays(1)).dense(s))[0]
    for i in range(SMALL.num_nodes):
        expected = [slot < length or (slot - length < SMALL.num_nodes and SMALL.ancestors[i, slot - length])
                    for slot in range(s)]
        assert mask[i].tolist() == expected


def test_greedy_accept_follows_the_longest_matching_path():
    # Target argmax per node; the accepted path is root -> 2 -> 5 (node 1 mismatches).
    tokens = jnp.asarray([[10, 11, 12, 13, 14, 15, 16]])
    target = jnp.asarray([[12, 99, 15, 0, 0, 77, 0]])
    acc = greedy_accept(tokens, target, jnp.ones((1, 7), bool), SMALL.arrays(1))
    assert np.flatnonzero(np.asarray(acc)[0]).tolist() == [0, 2, 5]
    invalid = jnp.ones((1, 7), bool).at[0, 5].set(False)  # an unproposed node is never accepted
    assert np.flatnonzero(np.asarray(greedy_accept(tokens, target, invalid, SMALL.arrays(1)))[0]).tolist() == [0, 2]


def test_commit_moves_the_accepted_path_into_contiguous_slots():
    s, length = 16, 4
    buf = jnp.arange(s, dtype=jnp.float32)[None, :, None, None] * jnp.ones((1, s, 1, 2))
    cache = [{"k": buf, "v": buf + 100}]
    path = jnp.asarray([SMALL.path_table[6]])  # nodes 0, 1, 3, 6 at slots 4, 5, 7, 10
    out = commit_path(cache, jnp.asarray([length]), path, SMALL.num_nodes)
    k = np.asarray(out[0]["k"])[0, :, 0, 0]
    assert k[:length].tolist() == [0, 1, 2, 3]              # the committed prefix is untouched
    assert k[length:length + 4].tolist() == [4, 5, 7, 10]   # root + accepted nodes, now contiguous
    assert np.asarray(out[0]["v"])[0, length + 3, 0, 0] == 110


def chosen_paths(arrays, ranks, row=0) -> list[tuple[int, ...]]:
    """A dynamic tree's nodes as rank paths, in node order."""
    parents, ranks = np.asarray(arrays.parents[row]), np.asarray(ranks[row])
    paths = [()]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + (int(ranks[i - 1]),))
    return paths[1:]


@pytest.mark.parametrize("size", [8, 16])
def test_a_dynamic_tree_under_the_static_trees_estimate_is_that_static_tree(size):
    # configs/trees/tree-N are the N best paths when the rank-r candidate is right 0.6 * 0.4^r of the time.
    dynamic = trees.resolve(f"dynamic-{size}", 4)
    k = dynamic.max_rank + 1
    arrays, depth, rank = jax.jit(dynamic.layout)(jnp.log(jnp.broadcast_to(0.6 * 0.4 ** jnp.arange(k), (1, 4, k))))
    static = trees.resolve(f"tree-{size}", 4)
    assert chosen_paths(arrays, rank) == list(static.paths)
    assert np.asarray(depth[0]).tolist() == (static.node_depths[1:] - 1).tolist()
    for got, want in zip(arrays, static.arrays(1)):
        np.testing.assert_array_equal(got[..., :want.shape[-1]], want)


def test_a_dynamic_tree_is_the_best_closed_set_and_verification_reads_it_as_a_static_one():
    rng = np.random.default_rng(0)
    dynamic = trees.DynamicTree(12, 3, width=4)
    logq = np.sort(np.log(rng.dirichlet(np.ones(40) * 0.3, size=(3, 3))), axis=-1)[..., ::-1][..., :4]
    logq[1, 1, 2:] = -np.inf  # sampling's q can be 0 (top-k, top-p): such nodes still make a tree
    arrays, depth, rank = jax.jit(dynamic.layout)(jnp.asarray(logq, jnp.float32))  # op by op: 100 compiles
    for row in range(3):
        paths = chosen_paths(arrays, rank, row)
        spec = TreeSpec.from_paths(paths)  # raises unless every node's parent was chosen before it
        assert paths == list(spec.paths) and len(paths) == 12
        spec.check_sampling()  # children hold ranks 0..m-1
        static = spec.arrays(1)
        for name, got, want in zip(arrays._fields, arrays, static):
            got = np.asarray(got[row:row + 1])
            np.testing.assert_array_equal(got[..., :want.shape[-1]], want)
            # Past a shallower or narrower tree: paths repeat the node, children are -1.
            pad = np.arange(13)[None, :, None] if name == "paths" else -1
            assert (got[..., want.shape[-1]:] == pad).all()
        np.testing.assert_array_equal(arrays.ancestors[row], spec.ancestors)
        # No candidate left out is likelier than one chosen (the chosen set is the best that is a tree).
        joint = {p: sum(logq[row, d, r] for d, r in enumerate(p)) for p in dynamic.candidates.paths}
        rest = [v for p, v in joint.items() if p not in set(paths)]
        assert min(joint[p] for p in paths) >= max(rest)


def test_dynamic_tree_names():
    from s3djax.speculative.drafters import s3d

    assert trees.resolve("dynamic-16", 4).num_nodes == 17 and trees.resolve("dynamic-16", 4).depth == 4
    # Unset, gamma is the paper's 4 for a dynamic tree, not the CPU chain's 1 (which holds only 8 candidates).
    assert s3d.default_gamma("dynamic-16") == s3d.PAPER_GAMMA
    with pytest.raises(UserError, match="at least dynamic-4"):
        trees.resolve("dynamic-3", 4)
    with pytest.raises(UserError, match="raise --gamma"):  # at gamma 1 there are only 8 candidates
        trees.resolve("dynamic-8", 1)


def test_with_nothing_measured_the_defaults_are_the_data_files_on_every_vector_unit(monkeypatch):
    # No table of vector units in code: S3DJAX_DEFAULTS=fixed (the suite's) takes configs/defaults.yaml by backend,
    # whatever the CPU; a named tree keeps its own depth and a dynamic one the paper's.
    from cpu_kernels import matmul
    from s3djax import built, defaults
    from s3djax.options import Options
    from s3djax.speculative import draft_weights
    from s3djax.speculative.drafters import s3d

    chain = types.SimpleNamespace(tree=trees.resolve("chain", 4))  # a drafter's chain, all with_lookup reads
    seen = set()
    for isa in ("avx512", "avx2", None):
        monkeypatch.setattr(matmul, "isa", lambda isa=isa: isa)
        assert s3d.default_gamma("tree-16") == 4 and s3d.default_gamma("dynamic-16") == s3d.PAPER_GAMMA
        switch = {m: built.with_lookup(chain, Options(), m)[0].switch for m in ("s3d", "kangaroo")}
        seen.add((s3d.default_gamma(None), defaults.fallback("depth", "lookup"), draft_weights.default_mode(),
                  tuple(sorted(switch.items()))))
    assert seen == {(4, 2, "int8", (("kangaroo", 1), ("s3d", 2)))}
    # A flag overrides the file; --lookup 0 never gives way.
    assert built.with_lookup(chain, Options(lookup=3), "s3d")[0].switch == 3
    assert built.with_lookup(chain, Options(lookup=0), "s3d")[0] is chain
