"""A byte-level tokenizer built offline: one token per UTF-8 byte plus ``<pad>``, ``<s>`` and ``</s>``.

It is a ``tokenizers`` BPE model with the 256 byte symbols and no merges, wrapped as a transformers fast
tokenizer, so it works as the Trainer's ``processing_class``, saves with ``save_pretrained`` and loads
back with ``AutoTokenizer.from_pretrained`` without any code from this package.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
"""Special tokens, with ids 0, 1, 2; byte ``b`` has id ``b + 3``."""


def _byte_symbols() -> list[str]:
    """The printable character that byte-level pre-tokenization maps each byte 0..255 to, by byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols = {byte: chr(byte) for byte in printable}
    spare = 256
    for byte in range(256):
        if byte not in symbols:
            symbols[byte] = chr(spare)
            spare += 1
    return [symbols[byte] for byte in range(256)]


def byte_tokenizer(model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """The byte-level tokenizer (259 tokens); ``model_max_length`` is in tokens (= bytes)."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({symbol: len(SPECIAL_TOKENS) + byte for byte, symbol in enumerate(_byte_symbols())})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL_TOKENS])
    pad, bos, eos = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=pad,
        bos_token=bos,
        eos_token=eos,
        model_max_length=model_max_length,
    )
