"""Tokenizers behind one small API (encode, encode_concatenated, decode, byte_count,
save_pretrained): UTF-8 bytes, the reference's, or anything transformers' AutoTokenizer loads
(a local directory or a hub id)."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from dragon.data.sources import DataError, one_line


class ByteTokenizer:
    """The reference's tokenizer: UTF-8 bytes, vocab 256."""

    vocab_size = 256
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_concatenated(self, texts: list[str]) -> np.ndarray:
        """The ids of `texts` one after another (for packing)."""
        return np.frombuffer("".join(texts).encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Union[Sequence[int], torch.Tensor]) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        return bytes(ids).decode("utf-8", errors="replace")

    def byte_count(self, ids: Union[Sequence[int], torch.Tensor]) -> int:
        """UTF-8 bytes of the text `ids` stand for: one per id."""
        return len(ids)

    def save_pretrained(self, path: str) -> None:
        """The same tokenizer as transformers loads it (AutoTokenizer.from_pretrained): byte-level
        BPE with the 256 bytes as its vocabulary, id = byte value, and no merges."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        as_char = bytes_to_unicode()  # byte-level BPE's printable stand-in for each byte
        bpe = Tokenizer(models.BPE(vocab={as_char[b]: b for b in range(256)}, merges=[]))
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        bpe.decoder = decoders.ByteLevel()
        PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(path)

    __call__ = encode


class HFTokenizer:
    """A transformers tokenizer behind the ByteTokenizer API (no special tokens added); `name`
    is what --tokenizer_name gave (a hub id or a path)."""

    def __init__(self, tokenizer: Any, name: Optional[str] = None):
        self.tokenizer = tokenizer
        self.name = name or tokenizer.name_or_path
        self.vocab_size = len(tokenizer)  # includes added tokens, unlike tokenizer.vocab_size

    def encode(self, text: str) -> list[int]:
        # verbose=False: documents are longer than model_max_length by design (we pack them).
        return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    def encode_concatenated(self, texts: list[str]) -> np.ndarray:
        """The ids of `texts` one after another (for packing): one batched call, which the fast
        tokenizers run in Rust."""
        if not texts:
            return np.zeros(0, dtype=np.int64)
        ids = self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        return np.concatenate([np.asarray(doc, dtype=np.int64) for doc in ids])

    def decode(self, ids: Union[Sequence[int], torch.Tensor]) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        return self.tokenizer.decode(ids)

    def byte_count(self, ids: Union[Sequence[int], torch.Tensor]) -> int:
        """UTF-8 bytes of the text `ids` stand for (special tokens stand for none). A byte-level
        BPE token cut from its character at either end decodes to U+FFFD (3 bytes)."""
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        return len(self.tokenizer.decode(ids, skip_special_tokens=True).encode("utf-8"))

    __call__ = encode

    def save_pretrained(self, path: str) -> None:
        self.tokenizer.save_pretrained(path)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size})"


def tokenizer_in(directory: str, vocab_size: int) -> Union[ByteTokenizer, HFTokenizer]:
    """The tokenizer a run saved in `directory` (next to its checkpoints, or in an export);
    bytes when it saved none and the model has the byte vocabulary."""
    if os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
        return load_tokenizer(directory)
    if vocab_size != ByteTokenizer.vocab_size:
        raise DataError(
            f"{directory} holds no tokenizer and the model's vocabulary is {vocab_size}, not "
            "the 256 UTF-8 bytes; give --tokenizer_name"
        )
    return ByteTokenizer()


def load_tokenizer(name: Optional[str]) -> Union[ByteTokenizer, HFTokenizer]:
    """UTF-8 bytes for None, else what AutoTokenizer.from_pretrained(name) loads: a local
    directory saved with save_pretrained, or a hub id (from the hub's cache when HF_HUB_OFFLINE
    is set)."""
    if name is None:
        return ByteTokenizer()
    from transformers import AutoTokenizer  # deferred: importing transformers is slow

    local = os.path.isdir(name)
    if not local and (os.path.isabs(name) or name.startswith(".") or name.count("/") > 1):
        raise DataError(f"tokenizer_name {name!r}: no such directory, and not a hub id (NAME or "
                        "ORG/NAME); give a directory saved with save_pretrained() or a hub id")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local)
    except Exception as e:  # transformers raises many types (OSError, ValueError, KeyError...)
        if local:
            raise DataError(f"tokenizer_name {name!r} could not be loaded: {one_line(e)}") from e
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
        reach = ("HF_HUB_OFFLINE is set and the hub's cache holds no copy" if offline else
                 "the hub could not be reached (set HF_HUB_OFFLINE=1 to use its cache only)")
        raise DataError(
            f"tokenizer_name {name!r} is not a local directory and {reach}: {one_line(e, 120)}; "
            "give a hub id that is cached or reachable, or a directory saved with "
            "save_pretrained(), or omit it for UTF-8 bytes"
        ) from e
    return HFTokenizer(tokenizer, name)
