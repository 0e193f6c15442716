"""Token trees: static ones (a list of candidate-rank paths), dynamic ones (chosen each step from
the draft's probabilities), and the arrays verification reads either from.

Node 0 is the root (the last emitted token). A path (r1, r2, ..., rd) is the node at depth d whose
token is the draft's rank-rd candidate for position p + d, under the node (r1, ..., r(d-1)).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import itertools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from s3djax.errors import UserError


class TreeArrays(NamedTuple):
    """A tree as batched arrays, root first: what verification reads. A static tree's are constants;
    a dynamic tree's change every step, at the same shapes, so one executable serves both."""
    depths: jax.Array    # [B, N]
    parents: jax.Array   # [B, N] (the root is its own parent)
    paths: jax.Array     # [B, N, D + 1]: each node's ancestors by depth, root first, padded with the node
    children: jax.Array  # [B, N, W]: node indices in rank order, -1 padded

    @property
    def num_nodes(self) -> int:
        return self.depths.shape[1]

    @property
    def depth(self) -> int:
        return self.paths.shape[2] - 1

    @property
    def ancestors(self) -> jax.Array:
        """[B, N, N] bool: node i may attend to node j (j is i or an ancestor of i)."""
        return jnp.any(self.paths[..., None] == jnp.arange(self.num_nodes), axis=2)


def ancestor_matrix(parents: np.ndarray) -> np.ndarray:
    """[N, N] bool from each node's parent (every parent before its child, the root its own): node i may
    attend to node j (j is i or an ancestor of i)."""
    anc = np.eye(len(parents), dtype=bool)
    for i in range(1, len(parents)):
        anc[i] |= anc[parents[i]]
    return anc


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    paths: tuple[tuple[int, ...], ...]  # sorted by depth, then lexicographically; root excluded
    dynamic = False

    def __post_init__(self):
        seen = set()
        for path in self.paths:
            if not path or any(r < 0 for r in path):
                raise UserError(f"invalid tree: path {path} must be a non-empty tuple of ranks >= 0")
            if path in seen:
                raise UserError(f"invalid tree: path {path} appears twice")
            if len(path) > 1 and path[:-1] not in seen:
                raise UserError(f"invalid tree: path {path} has no parent {path[:-1]} before it")
            seen.add(path)

    @classmethod
    def from_paths(cls, paths) -> "TreeSpec":
        paths = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        if not paths:
            raise UserError("invalid tree: it has no nodes")
        return cls(tuple(paths))

    @classmethod
    def chain(cls, gamma: int) -> "TreeSpec":
        if gamma < 1:
            raise UserError(f"invalid tree: a chain needs gamma >= 1, got {gamma}")
        return cls(tuple((0,) * d for d in range(1, gamma + 1)))

    @classmethod
    def spine(cls, depth: int, width: int) -> "TreeSpec":
        """An autoregressive drafter's tree: a chain of rank-0 tokens, and at every depth the
        next-ranked candidates as leaves beside it (width 1 is the chain)."""
        if depth < 1 or width < 1:
            raise UserError(f"invalid tree: depth and width must be at least 1, got {depth} and {width}")
        return cls(tuple((0,) * (d - 1) + (r,) for d in range(1, depth + 1) for r in range(width)))

    @property
    def spine_width(self) -> int | None:
        """The width if this is a spine tree (chain included), else None."""
        width = self.max_rank + 1
        return width if self == TreeSpec.spine(self.depth, width) else None

    @property
    def spine_name(self) -> str | None:
        """The name `resolve` knows a spine tree by: chain or topK."""
        width = self.spine_width
        return None if width is None else "chain" if width == 1 else f"top{width}"

    @property
    def path_table(self) -> np.ndarray:
        """[N, depth + 1]: row i lists node i's ancestors by depth (root first), padded with i itself."""
        parents, depths = self.parents, self.node_depths
        table = np.zeros((self.num_nodes, self.depth + 1), np.int32)
        for i in range(self.num_nodes):
            table[i, :] = i
            node = i
            while node:
                table[i, depths[node]] = node
                node = parents[node]
            table[i, 0] = 0
        return table

    @property
    def num_nodes(self) -> int:  # root included
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @property
    def max_rank(self) -> int:
        return max((max(p) for p in self.paths), default=0)

    @property
    def node_depths(self) -> np.ndarray:
        return np.array([0] + [len(p) for p in self.paths], np.int32)

    @property
    def node_ranks(self) -> np.ndarray:
        return np.array([0] + [p[-1] for p in self.paths], np.int32)

    @property
    def parents(self) -> np.ndarray:
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        return np.array([0] + [index.get(p[:-1], 0) for p in self.paths], np.int32)

    @property
    def children(self) -> np.ndarray:
        """[N, max children] node indices in rank order, -1 padded (the order sampling tries them in)."""
        kids = [[] for _ in range(self.num_nodes)]
        for i, (parent, rank) in enumerate(zip(self.parents[1:], self.node_ranks[1:]), start=1):
            kids[parent].append((rank, i))
        width = max(1, max(map(len, kids)))
        return np.array([[i for _, i in sorted(k)] + [-1] * (width - len(k)) for k in kids], np.int32)

    def check_sampling(self) -> None:
        """Sampled verification tries a node's children as consecutive draws without replacement, so a
        node's children must hold ranks 0..m-1 with none missing."""
        for row in self.children:
            ranks = sorted(int(self.node_ranks[i]) for i in row if i >= 0)
            if ranks != list(range(len(ranks))):
                raise UserError(f"this tree cannot be sampled: a node's children have ranks {ranks}, not 0..{len(ranks) - 1}")

    @property
    def ancestors(self) -> np.ndarray:
        """[N, N] bool: node i may attend to node j (j is i or an ancestor of i)."""
        return ancestor_matrix(self.parents)

    def arrays(self, batch: int) -> TreeArrays:
        return TreeArrays(*(jnp.broadcast_to(jnp.asarray(a), (batch,) + a.shape)
                            for a in (self.node_depths, self.parents, self.path_table, self.children)))

    def layout(self, scores) -> tuple[TreeArrays, jax.Array, jax.Array]:
        """(arrays, depth - 1 [B, N - 1], rank [B, N - 1]) of every drafted node; a static tree's do not
        depend on the draft's top-k log-probabilities `scores` [B, gamma, K]."""
        b = scores.shape[0]
        at = (self.node_depths[1:] - 1, self.node_ranks[1:])
        return self.arrays(b), *(jnp.broadcast_to(jnp.asarray(a), (b, len(a))) for a in at)


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """The `size` nodes of highest joint draft log-probability, chosen at every step.

    For a drafter whose candidates at depth d do not depend on the parent (S3D's simultaneous
    draft), a path's joint log-probability is the sum of its ranks' log-probabilities by depth, so
    the best `size` paths are picked from every path up to `gamma` deep and `width` wide that can
    fit in `size` nodes. A child never scores above its parent, nor a rank above the rank before
    it, and ties go to the earlier path, so the chosen set is a tree whose children hold ranks
    0..m-1: what sampled verification needs. The node count is fixed, so it compiles once.
    """
    size: int   # drafted nodes, root excluded
    gamma: int
    width: int = 8
    dynamic = True

    def __post_init__(self):
        if self.size < self.gamma:
            raise UserError(f"invalid tree: dynamic-{self.size} cannot hold a chain of gamma {self.gamma}; "
                            f"use at least dynamic-{self.gamma}")
        if self.size >= len(self.candidates.paths):
            raise UserError(f"invalid tree: at gamma {self.gamma}, dynamic-{self.size} would hold every path it could "
                            f"choose from; raise --gamma or use a static tree")

    @functools.cached_property
    def candidates(self) -> TreeSpec:
        """Every path a `size`-node tree may hold: one with ranks r1..rd needs sum(ri + 1) nodes."""
        width = min(self.width, self.size)
        paths = [p for d in range(1, self.gamma + 1) for p in itertools.product(range(width), repeat=d)
                 if sum(p) + d <= self.size]
        return TreeSpec.from_paths(paths)

    @property
    def num_nodes(self) -> int:
        return self.size + 1

    @property
    def depth(self) -> int:
        return self.gamma

    @property
    def max_rank(self) -> int:
        return min(self.width, self.size) - 1

    spine_width = None

    def check_sampling(self) -> None:
        pass  # every chosen tree's children hold ranks 0..m-1 (see the class)

    def arrays(self, batch: int) -> TreeArrays:
        """The tree of a flat draft: the first `size` candidate paths (shapes for the loop's state)."""
        return self.layout(jnp.zeros((batch, self.gamma, self.max_rank + 1), jnp.float32))[0]

    def layout(self, scores) -> tuple[TreeArrays, jax.Array, jax.Array]:
        """`TreeSpec.layout` for the tree these top-k log-probabilities [B, gamma, K] choose."""
        cand = self.candidates
        b, num = scores.shape[0], cand.num_nodes
        depths, ranks, parents = cand.node_depths, cand.node_ranks, cand.parents
        joint = jnp.zeros((b, num), jnp.float32)
        for d in range(1, self.gamma + 1):  # parent first, so a child's sum is its parent's plus one term <= 0
            level = np.flatnonzero(depths == d)
            joint = joint.at[:, level].set(joint[:, parents[level]] + scores[:, d - 1, ranks[level]].astype(jnp.float32))
        index = jnp.broadcast_to(jnp.arange(1, num, dtype=jnp.int32), (b, num - 1))
        # Best first, the earlier path on a tie; then back to candidate order, where parents come first.
        _, best = jax.lax.sort((-joint[:, 1:], index), dimension=1, num_keys=2)
        chosen = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.sort(best[:, :self.size], axis=1)], axis=1)
        rows = jnp.arange(b)[:, None]
        where = jnp.full((b, num), -1, jnp.int32).at[rows, chosen].set(jnp.arange(self.num_nodes, dtype=jnp.int32))

        def renumber(table):  # candidate indices [B, N, ...] -> chosen-node indices, -1 where not chosen
            flat = table.reshape(b, -1)
            return jnp.where(flat >= 0, jnp.take_along_axis(where, jnp.maximum(flat, 0), axis=1), -1).reshape(table.shape)

        arrays = TreeArrays(jnp.asarray(depths)[chosen], renumber(jnp.asarray(parents)[chosen]),
                            renumber(jnp.asarray(cand.path_table)[chosen]), renumber(jnp.asarray(cand.children)[chosen]))
        return arrays, jnp.asarray(depths - 1)[chosen[:, 1:]], jnp.asarray(ranks)[chosen[:, 1:]]


def named_trees() -> dict[str, list]:
    from s3djax.registry import CONFIG_DIR

    out = {}
    for file in sorted(glob.glob(os.path.join(CONFIG_DIR, "trees", "*.yaml"))):
        with open(file) as f:
            spec = yaml.safe_load(f)
        out[spec["name"]] = spec["paths"]
    return out


def named_depth(name: str) -> int | None:
    """A tree in configs/trees/'s depth; None for `chain` and `topK`, whose depth is gamma."""
    paths = named_trees().get(name)
    return TreeSpec.from_paths(paths).depth if paths else None


def resolve(name: str | None, gamma: int) -> TreeSpec | DynamicTree:
    """`chain` (also None, the default) is a chain of gamma nodes, `topK` (top2, top3, ...) a gamma-deep
    spine of width K, `dynamic-N` N nodes chosen each step; other names come from configs/trees/."""
    if name in (None, "chain"):
        return TreeSpec.chain(gamma)
    if name.startswith("top") and name[3:].isdigit() and int(name[3:]) >= 1:
        return TreeSpec.spine(gamma, int(name[3:]))
    if name.startswith("dynamic-") and name[8:].isdigit() and int(name[8:]) >= 1:
        return DynamicTree(int(name[8:]), gamma)
    trees = named_trees()
    if name not in trees:
        raise UserError(f"unknown tree {name!r}; known trees: chain, topK (top2, top3, ...), dynamic-N "
                        f"(dynamic-16, ...), {', '.join(trees)}")
    tree = TreeSpec.from_paths(trees[name])
    if tree.depth > gamma:
        raise UserError(f"tree {name} is {tree.depth} deep but --gamma is {gamma}; raise --gamma to {tree.depth}")
    return tree
