"""Megatron-core training engine (``engine.MegatronEngine``): Qwen2/Llama GPTModel with TP/PP/DP, HF weight
conversion (``hf_conversion``), and the CPU stand-ins it needs without a GPU (``cpu_compat``). Importing this
package does not import megatron-core; building an engine does."""
