"""A tiny real tokenizer for serving tests: byte-level BPE (so random token ids decode to
partial UTF-8 that the detokenizer must hold back), a BOS that the tokenizer adds to
every encoding, and a Llama-4-style chat template that starts with BOS too, so a server
that tokenizes the templated text with special tokens gets BOS twice."""

from __future__ import annotations

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|header_start|>{{ m['role'] }}<|header_end|>\n\n"
    "{{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}")

SPECIALS = ["<|begin_of_text|>", "<|eot|>", "<|header_start|>", "<|header_end|>"]

_CORPUS = [
    "the quick brown fox jumps over the lazy dog", "chunked local attention over a paged cache",
    "a token attends to keys in its own chunk", "serving requests to clients over http",
    "naïve café déjà vu — ünïcödé façade", "数据 注意力 分块 缓存", "emoji 🙂 🚀 ✨ in text",
    "system user assistant hello world how are you today",
]


def write_tiny_tokenizer(path, vocab_size: int = 384, chat_template: bool = True) -> int:
    """Save a transformers fast tokenizer to ``path``; return its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    bos = tok.token_to_id(SPECIALS[0])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIALS[0]} $A", pair=f"{SPECIALS[0]} $A $B",
        special_tokens=[(SPECIALS[0], bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0],
                                   eos_token=SPECIALS[1])
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return tok.get_vocab_size()
