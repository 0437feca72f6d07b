"""One decoding step's rows: which tokens, at which positions, seeing what. Every decoder builds its steps here.

A FAFO step, drawn as llama.cpp's lookahead example draws its batch (t: the anchor's position; G candidates of
k tokens; a window of W streams and k levels):

| rows          | role                          | position  | sees in the cache | sees among this step's rows           |
|---------------|-------------------------------|-----------|-------------------|---------------------------------------|
| 0             | anchor x_t                    | t         | every position    | itself                                |
| 1 .. G·k      | verify: candidate c, token j  | t + 1 + j | every position    | the anchor, its candidate up to j     |
| next W − 1    | window level 0, column i      | t + i     | C(kv) only        | the anchor, level-0 columns 1..i      |
| next (k−1)·W  | window level l ≥ 1, column i  | t + l + i | C(kv) only        | the anchor, level-0 columns 1..i and  |
|               |                               |           |                   | column i of levels 1..l (a staircase) |

Logits are read for the verify rows and for the window rows that predict the next level. Plain decoding is the
anchor alone; the tree-verified peers are the anchor and a draft tree whose nodes see the anchor and their
ancestors (FAFO's candidates are such a tree, one chain each). Rows that see only C(kv) need a `CacheView`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol

import torch

from .syncs import upload

if TYPE_CHECKING:
    from .model import Attention


@dataclass(frozen=True, eq=False)  # compared by identity: step layouts are cached per ViewRows object
class ViewRows:
    """Rows after the verify rows that see only a compressed view of the cache (FAFO's lookahead window)."""

    offsets: tuple[int, ...]  # position of each row relative to the anchor
    local: torch.Tensor  # [rows, 1 + rows]: column 0 is the anchor, then these rows
    read: tuple[int, ...]  # the rows (of these) whose logits are read


@dataclass(frozen=True, eq=False)
class RowLayout:
    """Everything about a step's rows that depends only on its shape: built once per shape and device, so its
    tensors live for the process (FlexAttention's block masks are keyed by them)."""

    offsets: torch.Tensor  # [rows] position relative to the anchor
    local: torch.Tensor  # [rows, rows]: which of this step's rows each row sees
    verify_rows: int  # the anchor and the draft rows, first: they see every cached position
    verify_local: torch.Tensor  # [verify, verify]
    view_local: torch.Tensor | None  # [view rows, 1 + view rows], ViewRows.local
    sees_cache: torch.Tensor | None  # [rows] booleans: every cached position (true) or only the view; None: all
    logit_rows: torch.Tensor | None  # the rows whose logits are read, in order; None: all

    @property
    def rows(self) -> int:
        return self.offsets.shape[0]


class CacheView(Protocol):
    """What the rows that do not see the whole cache see instead (FAFO's compressed C(kv))."""

    def view_mask(self) -> torch.Tensor | None:
        """The view as booleans [length, layers] (the compiled step's masked attention); None: every position."""

    def attention(self, layout: RowLayout) -> "Attention":
        """The eager attention of a step with this layout."""


@dataclass(frozen=True)
class StepRows:
    """One step's description, all the session needs to run it."""

    ids: list[int]
    layout: RowLayout
    size: int = 1  # the rows a compiled step pads this one to (a decoder pads its steps alike, one package)
    view: CacheView | None = None  # needed when some rows see only a view of the cache
    compiled: bool = True  # may run as a compiled step


def plain_step(token: int, device: torch.device) -> StepRows:
    """Plain decoding: one row that sees everything."""
    return StepRows([token], _layout((), None, device))


def draft_step(anchor: int, tokens: list[int], parents: list[int], device: torch.device, *,
               size: int = 1, view_tokens: list[int] | None = None, view_rows: ViewRows | None = None,
               view: CacheView | None = None, compiled: bool = True) -> StepRows:
    """The anchor, a draft tree (`tokens` with their `parents`, -1 for the anchor, parents first) with tree
    attention over the whole cache, then optional `view_rows` (`view_tokens`) that see only `view`."""
    layout = _layout(tuple(parents), view_rows, device)
    return StepRows([anchor, *tokens, *(view_tokens or ())], layout, size, view, compiled)


@lru_cache(maxsize=1024)
def _layout(parents: tuple[int, ...], view_rows: ViewRows | None, device: torch.device) -> RowLayout:
    n_verify = 1 + len(parents)
    depths: list[int] = []
    verify_local = torch.zeros(n_verify, n_verify, dtype=torch.bool)
    verify_local[:, 0] = True
    for node, parent in enumerate(parents):
        row = node + 1
        depths.append(1 if parent < 0 else depths[parent] + 1)
        if parent >= 0:
            verify_local[row] = verify_local[parent + 1]
        verify_local[row, row] = True
    offsets = [0, *depths]
    if view_rows is None:
        on_device = upload(verify_local, device)
        return RowLayout(upload(offsets, device), on_device, n_verify, on_device, None, None, None)
    n_view = len(view_rows.offsets)
    local = torch.zeros(n_verify + n_view, n_verify + n_view, dtype=torch.bool)
    local[:n_verify, :n_verify] = verify_local
    local[n_verify:, 0] = view_rows.local[:, 0]
    local[n_verify:, n_verify:] = view_rows.local[:, 1:]
    logit_rows = [*range(n_verify), *(n_verify + r for r in view_rows.read)]
    return RowLayout(upload(offsets + list(view_rows.offsets), device), upload(local, device), n_verify,
                     upload(verify_local, device), upload(view_rows.local, device),
                     upload(torch.arange(n_verify + n_view) < n_verify, device), upload(logit_rows, device))

