"""Model definitions (Llama-4 text) over flat token batches and a paged KV cache."""

from chunklocal.models.llama4 import Llama4ForCausalLM, load_text_config
from chunklocal.models.loader import load_llama4

__all__ = ["Llama4ForCausalLM", "load_llama4", "load_text_config"]
