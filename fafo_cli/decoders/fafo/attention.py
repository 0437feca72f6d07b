"""The attention of a FAFO step: verify rows over the whole cache, fumble rows over C(kv) only.

Rows are [anchor, candidates..., window...]. With a compressed view, two attention calls per layer:
anchor + candidates attend over all L cached positions plus their step-local block; window rows attend over
the compressor's contiguous copy of C(kv) plus the anchor and their staircase. Without one (compressor
`none`, or a context within the budget) a single call serves all rows. Masks are the step-local templates
placed after an all-visible prefix in a reused buffer, never rebuilt from scratch.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ...runtime.cache import KVCache
from ...runtime.masks import PrefixMasks
from ...runtime.model import grouped_attention, on_device
from ...runtime.rows import RowLayout
from ...runtime.syncs import upload


class CompressedView:
    """C(kv) as a step's window rows see it (runtime.rows.CacheView): the compiled step's per-layer mask, or the
    eager split (or block-sparse) attention."""

    def __init__(self, cache: KVCache, compressor, scaling: float, *, block_masks: "BlockSparseMasks | None" = None,
                 flex=None):
        self.cache, self.compressor, self.scaling = cache, compressor, scaling
        self.block_masks, self.flex = block_masks, flex
        self.masks = PrefixMasks(cache.device)

    def view_mask(self) -> torch.Tensor | None:
        return self.compressor.view_mask(self.cache)

    def attention(self, layout: RowLayout) -> "FafoAttention":
        return FafoAttention(self, layout)


class FafoAttention:
    """The attention of one FAFO step, handed to Model.forward (see the module docstring)."""

    def __init__(self, view: CompressedView, layout: RowLayout):
        cache, compressor = view.cache, view.compressor
        self.cache, self.compressor, self.scaling, self.flex = cache, compressor, view.scaling, view.flex
        self.verify_rows = verify_rows = layout.verify_rows
        length = cache.length
        self.split = compressor.view(0) is not None
        # each mask folded for torch's kernel once a pass, not in every layer (folded_attention's memo: one per mask)
        self._memos: tuple[dict, dict] = ({}, {})
        self._copies: dict = {}  # the mask on a spread model's later GPUs
        self.observe = getattr(compressor, "observe", None) if getattr(compressor, "needs_query", False) else None
        if self.split:
            self.view_size = compressor.view_size(cache)
            # the anchor's and the window rows' slots in the cache, copied after the view in each layer
            start = length + verify_rows
            sources = torch.cat([torch.tensor([length]), torch.arange(start, start + layout.rows - verify_rows)])
            self.window_source = upload(sources, cache.device)
            if view.block_masks is not None:  # one FlexAttention call over [C(kv) region | positions]
                self.kv_length = cache.lead + cache.capacity
                self.block_mask = view.block_masks.get(lead=cache.lead, kv_length=self.kv_length, length=length,
                                                       view_size=self.view_size, layout=layout)
            else:
                self.block_mask = None
                self.verify_mask = view.masks.get("verify", length, layout.verify_local)
                self.window_mask = view.masks.get("window", self.view_size, layout.view_local)
        else:
            self.mask = view.masks.get("all", length, layout.local)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n_verify, start = self.verify_rows, self.cache.length
        if self.observe is not None:  # query-aware compressors learn from the anchor row
            self.observe(layer, q[0, :, 0], self.cache.keys[layer, :start])
        if not self.split:
            return grouped_attention(q, k, v, on_device(self.mask, q.device, self._copies), self.scaling,
                                     self._memos[0])
        # The window rows see C(kv), then the anchor and themselves: place those rows' keys after the view.
        view_k, view_v = self.compressor.view(layer)
        n = self.view_size
        end = n + len(self.window_source)
        torch.index_select(self.cache.keys[layer], 0, self.window_source, out=view_k[n:end])
        torch.index_select(self.cache.values[layer], 0, self.window_source, out=view_v[n:end])
        if self.block_mask is not None:
            keys = self.cache.storage_keys[layer, :self.kv_length].transpose(0, 1)[None]
            values = self.cache.storage_values[layer, :self.kv_length].transpose(0, 1)[None]
            # verify rows in the first query blocks, window rows from the next block boundary: each block's list
            # then names only what its rows see (padding rows are computed and dropped)
            window_at, padded = block_rows(n_verify, q.shape[2] - n_verify)
            rows = q.new_zeros(q.shape[0], q.shape[1], padded, q.shape[3])
            rows[:, :, :n_verify] = q[:, :, :n_verify]
            rows[:, :, window_at:window_at + q.shape[2] - n_verify] = q[:, :, n_verify:]
            out = self.flex(rows, keys, values, block_mask=self.block_mask, scale=self.scaling, enable_gqa=True)
            return torch.cat([out[:, :, :n_verify], out[:, :, window_at:window_at + q.shape[2] - n_verify]], dim=2)
        verify_end = start + n_verify
        verify = grouped_attention(q[:, :, :n_verify], k[:, :, :verify_end], v[:, :, :verify_end], self.verify_mask,
                                   self.scaling, self._memos[0])
        fumble = grouped_attention(q[:, :, n_verify:], view_k[:end].transpose(0, 1)[None],
                                   view_v[:end].transpose(0, 1)[None], self.window_mask, self.scaling, self._memos[1])
        return torch.cat([verify, fumble], dim=2)


BUCKET = 256  # positions per length bucket: one BlockMask serves every step whose rows end in the bucket
Q_BLOCK = 128  # FlexAttention's default block sizes
KV_BLOCK = 128
MOST_MASKS = 64  # BlockMasks kept per device (a tree's shape and a length bucket each): the least recently used go


_BLOCK_MASKS: dict[torch.device, "BlockSparseMasks"] = {}


def block_rows(n_verify: int, n_window: int) -> tuple[int, int]:
    """The block path's query layout: (the row the window rows start at, the padded row count). Verify rows fill
    the first query blocks and window rows start on the next block boundary, so no query block holds both: a
    block holding both would list every position block, and the window would skip nothing."""
    window_at = -(-n_verify // Q_BLOCK) * Q_BLOCK
    return window_at, window_at + -(-n_window // Q_BLOCK) * Q_BLOCK


class BlockSparseMasks:
    """FlexAttention BlockMasks for the block-sparse layout, built once per (length bucket, row shape).

    Keys are one tensor per layer: [leading region: C(kv), then the anchor and window rows | positions].
    Queries are laid out by `block_rows`: verify rows' q blocks list the position blocks up to the bucket's end,
    window rows' q blocks only the leading blocks. Every listed block is "partial", so `mask_mod` (which reads
    the live length and view size from tensors updated each step) decides inside each block.
    """

    def __init__(self, device: torch.device):
        # the live length and view size, read by the mask functions: updated in place each step
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self.view_size = torch.zeros((), dtype=torch.long, device=device)
        self.device = device
        self._masks: OrderedDict[tuple, tuple] = OrderedDict()

    @classmethod
    def for_device(cls, device: torch.device) -> "BlockSparseMasks":
        """One per device for the process: every tensor a mask function captures must outlive the request
        (FlexAttention may reuse a traced mask function, captured tensors included, across calls)."""
        if device not in _BLOCK_MASKS:
            _BLOCK_MASKS[device] = cls(device)
        return _BLOCK_MASKS[device]

    def get(self, *, lead: int, kv_length: int, length: int, view_size: int, layout: RowLayout):
        from torch.nn.attention.flex_attention import BlockMask

        self.length.fill_(length)
        self.view_size.fill_(view_size)
        n_verify, rows = layout.verify_rows, layout.rows
        n_window = rows - n_verify
        bucket = min(kv_length - lead, -(-(length + n_verify) // BUCKET) * BUCKET)
        key = (lead, kv_length, bucket, id(layout))
        if key not in self._masks:
            window_at, padded = block_rows(n_verify, n_window)
            lead_blocks = list(range(lead // KV_BLOCK))
            verify_blocks = list(range(lead // KV_BLOCK, -(-(lead + bucket) // KV_BLOCK)))
            lists = [verify_blocks if j * Q_BLOCK < window_at else lead_blocks for j in range(padded // Q_BLOCK)]
            q_blocks, width = len(lists), -(-kv_length // KV_BLOCK)  # FlexAttention wants a column per key block
            indices = torch.zeros(1, 1, q_blocks, width, dtype=torch.int32)
            for j, blocks in enumerate(lists):
                indices[0, 0, j, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            counts = torch.tensor([[[len(b) for b in lists]]], dtype=torch.int32)
            mask = BlockMask.from_kv_blocks(
                counts.to(self.device), indices.to(self.device), BLOCK_SIZE=(Q_BLOCK, KV_BLOCK),
                mask_mod=self._mask_mod(lead, layout, window_at), seq_lengths=(padded, kv_length))
            self._masks[key] = (mask, layout)  # the layout stays alive while kept, so its id names it
            if len(self._masks) > MOST_MASKS:  # (every step's tree may have its own shape: a long chat's would pile up)
                self._masks.popitem(last=False)
        self._masks.move_to_end(key)
        return self._masks[key][0]

    def _mask_mod(self, lead: int, layout: RowLayout, window_at: int):
        """Query row q (block_rows' layout) against key slot kv; padding rows see what the row before them sees
        (verify) or only the view (window), so no row is empty."""
        verify_local = layout.verify_local
        # the window's local mask with one extra, all-hidden row, so the indexing below is valid even with no window
        # rows; the mask function keeps it alive as long as the block mask
        view_local = layout.view_local
        n_verify, n_window = layout.verify_rows, 0 if view_local is None else view_local.shape[0]
        window_local = torch.zeros(n_window + 1, n_window + 1, dtype=torch.bool, device=verify_local.device)
        if view_local is not None:
            window_local[:n_window] = view_local
        length, view_size = self.length, self.view_size

        def mask_mod(b, h, q, kv):
            position = kv - lead
            local = position - length
            verify_ok = (position >= 0) & ((position < length) | (
                (local >= 0) & (local < n_verify) & verify_local[q.clamp(0, n_verify - 1), local.clamp(0, n_verify - 1)]))
            tail = kv - view_size
            window_ok = (kv < view_size) | ((tail >= 0) & (tail <= n_window) & window_local[
                (q - window_at).clamp(0, n_window), tail.clamp(0, n_window)])
            return torch.where(q < window_at, verify_ok, window_ok)

        return mask_mod


def flex_attention_kernel(device: torch.device):
    """FlexAttention, compiled where it pays (CUDA); eager elsewhere (correct, slow: a test path on CPU)."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    if device.type == "cuda":
        try:
            return torch.compile(flex_attention, dynamic=False)
        except Exception:  # noqa: BLE001 - no compiler available: eager still gives exact results
            pass

    def eager(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "use torch.compile" advice, printed once per process otherwise
            return flex_attention(*args, **kwargs)

    return eager
