"""The built-in rollout engine: continuous batching over a paged KV cache, behind SGLang/OpenAI-shaped HTTP."""
