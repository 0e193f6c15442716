"""Tokenizers through transformers: from a checkpoint folder, or rebuilt from a GGUF's metadata.

transformers can read a GGUF's tokenizer itself, but that parses the file a second time (about
6 s on two cores). We already hold the parsed file, so byte-level BPE vocabularies are rebuilt
from its fields directly; anything else falls back to transformers.
"""

from __future__ import annotations

import os

from s3djax.errors import UserError

_CONTROL = 3  # llama.cpp token_type for control (special) tokens


def from_folder(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"no usable tokenizer in {path} ({str(e).splitlines()[0]})") from None


def from_gguf(gf):
    """A PreTrainedTokenizerFast from a parsed `weights.GGUFFile`."""
    if gf.field("tokenizer.ggml.model") != "gpt2":
        from transformers import AutoTokenizer

        folder, name = os.path.split(gf.path)
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # Not AutoTokenizer here: importing the auto classes costs seconds (they pull in torch).
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = gf.field("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in gf.field("tokenizer.ggml.merges")]
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # llama.cpp's "smollm" pre-tokenizer splits digits one by one before GPT-2's regex, as the
    # original tokenizer.json does.
    backend.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                             if gf.field("tokenizer.ggml.pre") == "smollm" else byte_level)
    backend.decoder = decoders.ByteLevel()
    types = gf.field("tokenizer.ggml.token_type") or []
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(types) if kind == _CONTROL])

    def special(key):
        i = gf.field(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[i]

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=special("bos"), eos_token=special("eos"), unk_token=special("unknown"),
        pad_token=special("padding"), chat_template=gf.field("tokenizer.chat_template"))


def encode_prompt(tokenizer, text: str, chat_template: bool) -> list[int]:
    """Token ids of a user prompt, rendered with the chat template (system prompt included) unless asked not to."""
    if chat_template and tokenizer.chat_template:
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation ({"role", "content"} messages) rendered with the chat template, ready for the
    assistant's next message (a template's default system prompt included)."""
    if not tokenizer.chat_template:
        from s3djax.errors import UserError

        raise UserError("this model's tokenizer has no chat template, so it cannot hold a conversation")
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc)
