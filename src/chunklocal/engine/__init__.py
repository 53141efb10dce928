"""The serving engine: sequences, KV blocks, scheduling, model runner, LLM."""
