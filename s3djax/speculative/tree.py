"""Static token trees: a list of candidate-rank paths, and everything derived from it.

Node 0 is the root (the last emitted token). A path (r1, r2, ..., rd) is the node at depth d whose
token is the draft's rank-rd candidate for position p + d, under the node (r1, ..., r(d-1)).
"""

from __future__ import annotations

import dataclasses
import glob
import os

import numpy as np
import yaml

from s3djax.errors import UserError


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    paths: tuple[tuple[int, ...], ...]  # sorted by depth, then lexicographically; root excluded

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
        n, parents = self.num_nodes, self.parents
        anc = np.eye(n, dtype=bool)
        for i in range(1, n):
            anc[i] |= anc[parents[i]]
        return anc


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


def resolve(name: str, gamma: int) -> TreeSpec:
    """`chain` is a chain of gamma nodes, `topK` (top2, top3, ...) a gamma-deep spine of width K;
    other names come from configs/trees/."""
    if name == "chain":
        return TreeSpec.chain(gamma)
    if name.startswith("top") and name[3:].isdigit() and int(name[3:]) >= 1:
        return TreeSpec.spine(gamma, int(name[3:]))
    trees = named_trees()
    if name not in trees:
        raise UserError(f"unknown tree {name!r}; known trees: chain, topK (top2, top3, ...), {', '.join(trees)}")
    tree = TreeSpec.from_paths(trees[name])
    if tree.depth > gamma:
        raise UserError(f"tree {name} is {tree.depth} deep but --gamma is {gamma}; raise --gamma to {tree.depth}")
    return tree
