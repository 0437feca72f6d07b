"""The model architectures `Model.forward` computes exactly, by transformers' model_type (no torch needed: the hub
checks a model against them before anything is loaded).

Each decoder layer is: pre-norm attention (optional qkv bias, optional per-head q/k norm) with rotary embeddings,
then pre-norm gated MLP."""

# model_type -> architecture
SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(SUPPORTED.values())
