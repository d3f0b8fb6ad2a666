from tokenmill.executor.models.llama import LlamaForCausalLM

# every supported architecture runs on the same module; flags come from ModelConfig
MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
