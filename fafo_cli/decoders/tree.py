"""A draft tree: guessed tokens rooted at the anchor, verified together in one forward pass.

Node i is row 1 + i of the step (row 0 is the anchor, the root). Parents come before their children, so a
path's rows are increasing, which is the order `KVCache.commit_rows` needs. Each row sees the cache, the
anchor and its own ancestors (tree attention); its position is the anchor's plus its depth (runtime.rows lays
the step out). A chain of
guesses (prompt lookup, a self-draft) is a tree with one branch; FAFO's candidates are several chains.
"""

from __future__ import annotations

from typing import Sequence


ROOT = -1  # the parent of first-level nodes: the anchor


class DraftTree:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []  # 1 for the anchor's children
        self._children: dict[tuple[int, int], int] = {}  # (parent, token) -> node, for merged insertion

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        """A new child of `parent` (ROOT for the anchor); returns its node index."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent == ROOT else self.depths[parent] + 1)
        return len(self.tokens) - 1

    def add_chain(self, tokens: Sequence[int], parent: int = ROOT, merge: bool = True) -> int:
        """Append `tokens` below `parent`; with `merge`, reuse existing children with the same token (a trie),
        so shared prefixes cost one row. Returns the last node."""
        node = parent
        for token in tokens:
            existing = self._children.get((node, token)) if merge else None
            if existing is None:
                existing = self.add(node, token)
                self._children.setdefault((node, token), existing)
            node = existing
        return node

    @classmethod
    def chains(cls, chains: Sequence[Sequence[int]]) -> "DraftTree":
        """Independent chains from the anchor, one row per token (FAFO's candidate layout)."""
        tree = cls()
        for chain in chains:
            tree.add_chain(chain, merge=False)
        return tree

    def within(self, depth: int) -> "DraftTree":
        """The nodes at most `depth` deep (itself when that is all of them): a path holds no more guesses."""
        if all(d <= depth for d in self.depths):
            return self
        tree, index = DraftTree(), {ROOT: ROOT}
        for node, (token, parent, d) in enumerate(zip(self.tokens, self.parents, self.depths)):
            if d <= depth:  # (a parent is shallower than its children: it is kept first)
                index[node] = tree.add(index[parent], token)
        return tree

    def path(self, node: int) -> list[int]:
        """Nodes from the anchor's child down to `node` (empty for ROOT)."""
        nodes = []
        while node != ROOT:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]
