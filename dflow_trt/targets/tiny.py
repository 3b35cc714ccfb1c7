"""Tiny random-init targets (Qwen3 and Llama) for fast tests, seeded, with a byte-level tokenizer.

The tokenizer is built offline with `tokenizers` (256 byte tokens + a few specials), so the CLI
works on tiny targets with text prompts and a chat template, with nothing downloaded.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

SPECIALS = ("<|endoftext|>", "<|mask|>", "<|im_start|>", "<|im_end|>")
BYTE_VOCAB = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _common(vocab_size: int) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                tie_word_embeddings=True, eos_token_id=BYTE_VOCAB + 3, pad_token_id=BYTE_VOCAB,
                bos_token_id=None, initializer_range=0.2)


def build_tiny(kind: str, seed: int = 0, vocab_size: int | None = None):
    """Return (model, tokenizer-or-None). A custom vocab_size (< 260) drops the tokenizer."""
    v = vocab_size or BYTE_VOCAB + len(SPECIALS)
    if kind == "qwen3":
        config, cls = Qwen3Config(**_common(v)), Qwen3ForCausalLM
    elif kind == "llama":
        config, cls = LlamaConfig(**_common(v)), LlamaForCausalLM
    else:
        raise ValueError(kind)
    if vocab_size is not None and vocab_size < BYTE_VOCAB + len(SPECIALS):
        config.eos_token_id = None
        config.pad_token_id = None
    g = torch.get_rng_state()
    torch.manual_seed(seed)
    with torch.device("cpu"):  # CPU RNG: the same weights whatever the default device (CUDA's RNG differs)
        model = cls(config).float().eval()
    torch.set_rng_state(g)
    tokenizer = byte_tokenizer() if vocab_size is None else None
    return model, tokenizer
