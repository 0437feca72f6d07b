"""Which GPU each part of a model spread over several GPUs lives on (the `gpus` setting).

Consecutive layers fill one GPU after another, each layer with its share of the KV cache (a layer's cache lives
on its layer's device, runtime/cache.py): the embedding and rotary tables on the first GPU, the final norm and
the vocabulary projection after the last layer. The result is accelerate's `device_map`, which transformers'
`from_pretrained` loads each weight straight onto its device with.
"""

from __future__ import annotations

from dataclasses import dataclass

HEADROOM = 0.9  # of each GPU's free memory: the rest for activations, masks and the allocator's slack


@dataclass(frozen=True)
class Sizes:
    """Bytes of a model's parts, the KV cache at full context included."""
    embedding: int  # input embedding table (and anything else kept with it)
    layer: int  # one decoder layer's weights plus its KV cache
    head: int  # final norm and vocabulary projection
    n_layers: int


class DoesNotFit(ValueError):
    """The model and its cache do not fit in the given GPUs."""


def spread(sizes: Sizes, budgets: list[int]) -> tuple[list[int], int]:
    """(the GPU index of each layer, the GPU of the norm and head): layers fill GPUs in order, each to its budget
    (bytes); the first GPU also holds the embedding, and the head goes after the last layer, on a further GPU if
    it does not fit beside it."""
    if not budgets:
        raise DoesNotFit("no GPU to place the model on")
    gpu, used, layers = 0, sizes.embedding, []
    if used > budgets[0]:
        raise DoesNotFit(f"the embedding alone ({_gb(sizes.embedding)}) exceeds GPU 0's budget ({_gb(budgets[0])})")
    for index in range(sizes.n_layers):
        while used + sizes.layer > budgets[gpu]:
            gpu, used = gpu + 1, 0
            if gpu == len(budgets):
                raise DoesNotFit(f"layer {index} of {sizes.n_layers} does not fit: {len(budgets)} GPU(s) hold "
                                 f"{_gb(sum(budgets))} and the model with its cache needs {_gb(total(sizes))}")
        layers.append(gpu)
        used += sizes.layer
    if used + sizes.head > budgets[gpu]:
        gpu += 1
        if gpu == len(budgets) or sizes.head > budgets[gpu]:
            raise DoesNotFit(f"the vocabulary projection ({_gb(sizes.head)}) fits on no GPU after the last layer")
    return layers, gpu


def device_map(layers: list[int], head: int) -> dict[str, int]:
    """accelerate's device_map of a Llama-family model (model.embed_tokens, model.layers.i, model.norm, lm_head): the
    embedding on the first GPU, where `spread` counted it, even where the first layer did not fit beside it."""
    mapping = {"model.embed_tokens": 0, "model.rotary_emb": 0}
    mapping.update({f"model.layers.{i}": gpu for i, gpu in enumerate(layers)})
    mapping.update({"model.norm": head, "lm_head": head})
    return mapping


def total(sizes: Sizes) -> int:
    return sizes.embedding + sizes.n_layers * sizes.layer + sizes.head


def _gb(size: int) -> str:
    return f"{size / 1e9:.1f} GB"


def sizes_of(hf_model, dtype_bytes: int, max_context: int) -> Sizes:
    """The parts of a (meta-device) Llama-family model in bytes, at `dtype_bytes` per parameter, each layer with its
    KV cache at `max_context` positions. A tied head adds only the final norm (it is the embedding)."""
    config, inner = hf_model.config, hf_model.model

    def size(module) -> int:
        return sum(p.numel() for p in module.parameters()) * dtype_bytes

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = 2 * max_context * config.num_key_value_heads * head_dim * dtype_bytes
    tied = _tied(hf_model)
    return Sizes(embedding=size(inner.embed_tokens), layer=size(inner.layers[0]) + cache,
                 head=size(inner.norm) + (0 if tied else size(hf_model.lm_head)), n_layers=len(inner.layers))


def plan(hf_model, dtype_bytes: int, max_context: int, free_bytes: list[int]) -> dict[str, int]:
    """The device_map spreading `hf_model` (meta) over GPUs with `free_bytes` free each (HEADROOM of it used); a
    tied head stays with the embedding on the first GPU."""
    sizes = sizes_of(hf_model, dtype_bytes, max_context)
    layers, head = spread(sizes, [int(free * HEADROOM) for free in free_bytes])
    if _tied(hf_model):
        head = 0
    return device_map(layers, head)


def _tied(hf_model) -> bool:
    """Whether the head is the embedding (as the config says: a model built on "meta" may not have tied them yet)."""
    return bool(getattr(hf_model.config, "tie_word_embeddings", False))
