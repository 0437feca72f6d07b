"""QuantSpec: self-speculation through a 4-bit copy of the KV cache.

The draft is the model itself reading a 4-bit quantized copy of the cache (keys per channel, values per
token, in groups of G = `quantspec_group`) plus, in full precision, the newest G to 2G - 1 positions (the
paper's double buffer; read straight from the exact cache, so it costs nothing extra), and through a 4-bit
group-wise copy of the model's weights (`weights4.py`). It drafts
`quantspec_gamma` tokens, one pass each; one pass of the model over the exact cache verifies them. Unlike
the paper's target (which reads an 8-bit cache), ours reads the exact cache: the 4-bit copy is extra memory.
"""

from __future__ import annotations

from typing import Iterator

import torch

from ..runtime.events import Step
from ..runtime.model import grouped_attention
from .quantiser import QuantizedKV, value_channel_group
from .weights4 import int4_weights
from ..runtime.session import Emitter, Request, Session
from ..errors import FafoError
from . import speculative
from .speculative import Draft, draft_chain


class QuantSpec:
    runs_model = True

    def __init__(self, config):
        self.gamma, self.group = config.quantspec_gamma, config.quantspec_group
        self.max_rows = self.gamma

    def start(self, session: Session, request: Request, text: list[int], draws) -> None:
        self.model, self.cache, self.session = session.model, session.cache, session
        self.sampling, self.draws = request.sampling, draws and draws.below()
        model = self.model
        try:  # (a matrix of odd width, or an odd head dimension: two 4-bit codes a byte, groups of an even size)
            self.weights = int4_weights(model)
            self.quantized = QuantizedKV(len(model.layers), model.n_kv_heads, model.head_dim, self.group, model.device)
        except ValueError as e:
            raise FafoError(f"quantspec cannot quantize this model to 4 bits: {e}") from None
        self._sync()

    def _sync(self) -> None:
        """Quantize what leaves the full-precision buffer: as in the paper's double buffer, the newest G to 2G - 1
        positions stay exact (G = quantspec_group), and a whole group moves into the 4-bit copy once 2G are held."""
        self.quantized.sync(self.cache.keys, self.cache.values, max(0, self.cache.length - self.group))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One draft row: the 4-bit copy's positions dequantized, then the exact newest ones."""
        n = self.quantized.length
        if n:
            keys, values = self.quantized.dequantize(layer, k.dtype)
            k = torch.cat([keys.transpose(0, 1)[None], k[:, :, n:]], dim=2)
            v = torch.cat([values.transpose(0, 1)[None], v[:, :, n:]], dim=2)
        return grouped_attention(q, k, v, None, self.model.scaling)

    def draft(self, text: list[int], room: int) -> Draft:
        n = min(self.gamma, room)
        if n <= 0:
            return Draft()
        self.session.reserve(self.cache.length + n)  # (the compiled steps' hold on the cache let go where it grows)
        tokens, drafts = draft_chain(self.model, self.cache, self.attend, text[-1], len(text) - 1, n, self.sampling,
                                     self.draws, linear=self.weights.linear)
        return Draft.chain(tokens, drafts, passes=n)

    def accepted(self, text: list[int], new: int) -> None:
        self._sync()

    def nbytes(self) -> int:
        return self.quantized.nbytes() + self.weights.nbytes()


def generate(session: Session, request: Request, emitter: Emitter) -> Iterator[Step]:
    group, head_dim = request.config.quantspec_group, session.model.head_dim
    try:  # (the values' channel groups: the setting's fault, said before the prompt is prefilled for nothing)
        value_channel_group(group, head_dim)
    except ValueError:
        raise FafoError(f"quantspec_group ({group}) must be at least the model's head dimension ({head_dim}) or "
                        "divide it") from None
    yield from speculative.generate(session, request, emitter, QuantSpec(request.config))
