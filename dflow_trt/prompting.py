"""Prompt text -> token ids, the same way for the CLI, the benchmark and the server."""

from __future__ import annotations

from .errors import UserError


def check_prompt(prompt, what: str = "--prompt") -> str:
    """Refuse what is not non-empty text before any model loads: a non-string, an empty string, or
    text that is not valid UTF-8 (undecodable argv bytes arrive as lone surrogates)."""
    if not isinstance(prompt, str):
        raise UserError(f"{what} must be text, got {prompt!r:.60}; give a string")
    if not prompt:
        raise UserError(f"empty prompt ({what}): give it some text")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{what} is not valid UTF-8 text (an undecodable byte at character {e.start}); "
                        f"give UTF-8 text") from None
    return prompt


def encode_prompt(tokenizer, prompt: str, chat: bool, what: str = "--prompt") -> list[int]:
    check_prompt(prompt, what)
    if tokenizer is None:
        raise UserError("this target has no tokenizer; use a named target or a checkpoint folder with one")
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def encode_prompts(target, texts: list[str], chat: bool, max_new_tokens: int,
                   names: list[str] | None = None) -> list[list[int]]:
    """Encode every prompt before any decoding, refusing one that is not text or leaves no room for
    `max_new_tokens` in the target's context; `names` say where each came from."""
    ctx, out = target.info.max_context, []
    for i, text in enumerate(texts):
        name = names[i] if names else f"prompt {i + 1}"
        ids = encode_prompt(target.tokenizer, text, chat, name)
        if ctx and len(ids) + max_new_tokens > ctx:
            raise UserError(f"{name} ({len(ids)} tokens) + --max-new-tokens {max_new_tokens} exceed the "
                            f"{ctx}-token context of {target.info.name}; shorten the prompt or lower --max-new-tokens")
        out.append(ids)
    return out
