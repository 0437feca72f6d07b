"""Acceptance rules: which guessed tokens plain decoding would have produced itself.

Every method verifies a `DraftTree` (one chain, several chains, or a real tree) in one forward pass and
accepts one path of it plus one token of its own. Row 0 is the anchor, node i is row 1 + i.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from ..runtime.sampling import Draws, Sampling, argmax_ids, pick, target_probs
from .tree import ROOT, DraftTree


def _row(node: int) -> int:
    return 0 if node == ROOT else node + 1


def accept_tree(tree: DraftTree, plain: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """(accepted path of nodes, emitted tokens); `plain(row)` is the token plain decoding emits after that row.

    A node is accepted when its parent is and its token is what plain decoding emits after its parent's row.
    The deepest accepted node wins (the earliest on ties: callers put their preferred guesses first). `plain` is
    asked only about the anchor's row and accepted nodes' rows.
    """
    accepted = [False] * len(tree)
    best, best_depth = ROOT, 0
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        if (parent == ROOT or accepted[parent]) and token == plain(_row(parent)):
            accepted[i] = True
            if tree.depths[i] > best_depth:
                best, best_depth = i, tree.depths[i]
    path = tree.path(best)
    return path, [tree.tokens[i] for i in path] + [plain(_row(best))]


def accept(tree: DraftTree, logits: torch.Tensor, sampling: Sampling, draws: Draws | None, position: int,
           argmax: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """(path, emitted tokens) for one-hot guesses verified by `logits` (row r: after row r's token); `position`
    is the position of the token after the anchor, `argmax` the rows' argmax where the caller has it.

    Greedy, plain decoding emits each row's argmax; sampling, it emits the token its `Draws` pick at the row's
    position (the anchor's position plus the row's depth, plus one). Either way the output is plain decoding's,
    token for token, and a guess is accepted with exactly the probability plain decoding gives it.
    """
    if sampling.greedy:
        return accept_tree(tree, (argmax if argmax is not None else argmax_ids(logits)).__getitem__)

    @functools.cache
    def sampled(row: int) -> int:
        depth = 0 if row == 0 else tree.depths[row - 1]
        return pick(target_probs(logits[row], sampling), draws.uniform(position + depth))

    return accept_tree(tree, sampled)


def accept_speculative(tokens: Sequence[int], target: Callable[[int], torch.Tensor], draft: Sequence[torch.Tensor],
                       draws: Draws, position: int) -> list[int]:
    """Emitted tokens for a chain sampled from draft distributions `draft[j]` (standard speculative sampling);
    `tokens[0]` is at `position`.

    Token j is accepted with probability min(1, p(x) / q(x)); the first rejection samples from the normalised
    residual max(0, p - q) and ends the step; a fully accepted chain adds one token from p. `target(j)` is the
    target distribution at chain position j (row j of the verify pass). The coin and the residual draw use
    streams 1 and 2 of the position, so neither is the number the chain's own token was drawn with.
    """
    emitted: list[int] = []
    for j, x in enumerate(tokens):
        p, q = target(j), draft[j]
        if draws.uniform(position + j, stream=1) * float(q[x]) < float(p[x]):
            emitted.append(x)
            continue
        residual = (p - q).clamp_min(0.0)
        total = residual.sum()
        residual = residual / total if total > 0 else p  # p == q up to rounding: p itself is the residual
        emitted.append(pick(residual, draws.uniform(position + j, stream=2)))
        return emitted
    emitted.append(pick(target(len(tokens)), draws.uniform(position + len(tokens))))
    return emitted
