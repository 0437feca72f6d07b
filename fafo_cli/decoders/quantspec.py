"""QuantSpec: self-speculation through a 4-bit copy of the KV cache.

The draft is the model itself reading a 4-bit quantized copy of the cache (`engine.quant`: keys per
channel, values per token, in groups) plus, in full precision, the newest positions that do not fill a
group yet (read straight from the exact cache, so the buffer costs nothing extra). It drafts
`quantspec_gamma` tokens, one pass each; one pass of the model over the exact cache verifies them. Unlike
the paper's target (which reads an 8-bit cache), ours reads the exact cache: the 4-bit copy is extra memory.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from ..runtime.events import Step
from .quantiser import QuantizedKV
from ..runtime.session import Emitter, Request, Session
from ..errors import FafoError
from . import speculative
from .speculative import Draft, draft_chain


class QuantSpec:
    runs_model = True

    def __init__(self, config):
        self.gamma, self.group = config.quantspec_gamma, config.quantspec_group
        self.max_rows = self.gamma

    def start(self, session: Session, request: Request, text: list[int], generator) -> None:
        self.model, self.cache = session.model, session.cache
        self.sampling, self.generator = request.sampling, generator
        model = self.model
        try:
            self.quantized = QuantizedKV(len(model.layers), model.n_kv_heads, model.head_dim, self.group, model.device)
        except ValueError:
            raise FafoError(f"quantspec_group ({self.group}) must be at least the model's head dimension "
                            f"({model.head_dim}) or divide it") from None
        self.quantized.sync(self.cache.keys, self.cache.values, self.cache.length)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One draft row: the 4-bit copy's positions dequantized, then the exact newest ones."""
        n = self.quantized.length
        if n:
            keys, values = self.quantized.dequantize(layer, k.dtype)
            k = torch.cat([keys.transpose(0, 1)[None], k[:, :, n:]], dim=2)
            v = torch.cat([values.transpose(0, 1)[None], v[:, :, n:]], dim=2)
        return F.scaled_dot_product_attention(q, k, v, scale=self.model.scaling, enable_gqa=True)

    def draft(self, text: list[int], room: int) -> Draft:
        n = min(self.gamma, room)
        if n <= 0:
            return Draft()
        tokens, drafts = draft_chain(self.model, self.cache, self.attend, text[-1], len(text) - 1, n, self.sampling,
                                     self.generator)
        return Draft.chain(tokens, drafts, passes=n)

    def accepted(self, text: list[int], new: int) -> None:
        self.quantized.sync(self.cache.keys, self.cache.values, self.cache.length)

    def nbytes(self) -> int:
        return self.quantized.nbytes()


def generate(session: Session, request: Request, emitter: Emitter) -> Iterator[Step]:
    yield from speculative.generate(session, request, emitter, QuantSpec(request.config))
