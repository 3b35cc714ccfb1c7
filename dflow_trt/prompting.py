"""Prompt text -> token ids, the same way for the CLI, the benchmark and the server."""

from __future__ import annotations

from .errors import UserError


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not prompt:
        raise UserError("empty prompt: pass --prompt with some text")
    if tokenizer is None:
        raise UserError("this target has no tokenizer; use a named target or a checkpoint folder with one")
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]
