"""Acceptance rules: which guessed tokens plain decoding would have produced itself.

Every method verifies a `DraftTree` (one chain, several chains, or a real tree) in one forward pass and
accepts one path of it plus one token of its own. Row 0 is the anchor, node i is row 1 + i.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .tree import ROOT, DraftTree


def _row(node: int) -> int:
    return 0 if node == ROOT else node + 1


def accept_greedy(tree: DraftTree, argmax: Sequence[int]) -> tuple[list[int], list[int]]:
    """(accepted path of nodes, emitted tokens) under greedy decoding; `argmax[row]` for every row.

    A node is accepted when its parent is and its token is the argmax of its parent's row. The deepest
    accepted node wins (the earliest on ties: callers put their preferred guesses first).
    """
    accepted = [False] * len(tree)
    best, best_depth = ROOT, 0
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        if (parent == ROOT or accepted[parent]) and token == argmax[_row(parent)]:
            accepted[i] = True
            if tree.depths[i] > best_depth:
                best, best_depth = i, tree.depths[i]
    path = tree.path(best)
    return path, [tree.tokens[i] for i in path] + [argmax[_row(best)]]


def accept_sampling(tree: DraftTree, target: Callable[[int], torch.Tensor],
                    generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """(path, emitted tokens) under sampling, exactly distributed as the target; `target(row)` is the target
    distribution of the token after that row.

    The guesses are one-hot drafts. Level by level, the distinct tokens among the children of the nodes still
    alive are tried in order: token x is accepted with probability p(x); on rejection p(x) = 0 and p is
    renormalised. An acceptance keeps the children that carry it; if every guess is rejected, the token is
    sampled from what is left of p and the step ends. Past the deepest accepted node, one token is sampled.
    """
    alive = [ROOT]
    emitted: list[int] = []
    p = target(0)
    while True:
        children = tree.children(alive)
        if not children:
            break
        p = p.clone()
        accepted = None
        for x in dict.fromkeys(tree.tokens[c] for c in children):
            if torch.rand((), generator=generator, device=p.device) < p[x]:
                accepted = x
                break
            p[x] = 0.0
            total = p.sum()
            if total <= 0:  # nothing left to sample from (x held all the mass, yet was rejected: rounding)
                break
            p /= total
        if accepted is None:
            break
        emitted.append(accepted)
        alive = [c for c in children if tree.tokens[c] == accepted]
        p = target(_row(alive[0]))
    emitted.append(int(torch.multinomial(p, 1, generator=generator)))
    return tree.path(alive[0]), emitted


def accept_speculative(tokens: Sequence[int], target: Callable[[int], torch.Tensor], draft: Sequence[torch.Tensor],
                       generator: torch.Generator | None) -> list[int]:
    """Emitted tokens for a chain sampled from draft distributions `draft[j]` (standard speculative sampling).

    Token j is accepted with probability min(1, p(x) / q(x)); the first rejection samples from the normalised
    residual max(0, p - q) and ends the step; a fully accepted chain adds one token from p. `target(j)` is the
    target distribution at chain position j (row j of the verify pass).
    """
    emitted: list[int] = []
    for j, x in enumerate(tokens):
        p, q = target(j), draft[j]
        if torch.rand((), generator=generator, device=p.device) * q[x] < p[x]:
            emitted.append(x)
            continue
        residual = (p - q).clamp_min(0.0)
        total = residual.sum()
        residual = residual / total if total > 0 else p  # p == q up to rounding: p itself is the residual
        emitted.append(int(torch.multinomial(residual, 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(target(len(tokens)), 1, generator=generator)))
    return emitted
