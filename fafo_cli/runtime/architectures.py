"""The model architectures `Model.forward` computes exactly, by transformers' model_type (no torch needed: the hub
checks a model against them before anything is loaded).

Each decoder layer is: pre-norm attention (optional qkv bias, optional per-head q/k norm) with rotary embeddings,
then pre-norm gated MLP."""

import json

from ..errors import FafoError

# model_type -> architecture
SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(SUPPORTED.values())


def check_architecture(config: dict, where: str) -> None:
    """Refuse, in one line, a config (config.json, or one read from a .gguf file) that names no causal LM we run."""
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise FafoError(f"{where}: the config's architectures must be a list of class names "
                        f"(got {json.dumps(architectures)[:60]})")
    kind = config.get("model_type")
    if kind is not None and not isinstance(kind, str):
        raise FafoError(f"{where}: the config's model_type must be a name (got {json.dumps(kind)[:60]})")
    if any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        # (transformers builds the model its model_type names: another one, e.g. Granite's scaled residuals, would
        # run through our supported architectures' steps)
        if kind is None or kind in SUPPORTED:
            return
        raise FafoError(f"{where} is a {kind} model (model_type {kind!r}), which fafo does not run (supported: "
                        f"{', '.join(SUPPORTED)})")
    if not architectures:  # GGUF metadata names only the model type
        if kind in SUPPORTED:
            return
        raise FafoError(f"{where} does not name a model architecture (model_type {kind!r})")
    if not str(architectures[0]).endswith(("ForCausalLM", "LMHeadModel")):
        raise FafoError(f"{where} is not a causal language model ({architectures[0]})")
    raise FafoError(f"unsupported architecture {architectures[0]} in {where} "
                    f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
