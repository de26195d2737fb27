"""Writes a byte-level BPE tokenizer in Hugging Face format (tokenizer.json,
tokenizer_config.json with a ChatML chat template), as Qwen models ship theirs."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
# ChatML, the format of Qwen's templates (without tools and thinking blocks).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): every byte is a token, so any text encodes; merges learned
    from `texts`. Special tokens get the first ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, folder: Path, model_max_length: int = 32768) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json; returns the special-token ids."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False} for t, i in ids.items()},
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ids
