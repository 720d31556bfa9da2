"""Loading tokenizers from local Hugging Face directories, avoiding AutoTokenizer's pitfall."""

from __future__ import annotations

import os
from pathlib import Path


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    """The tokenizer saved in ``path``.

    With transformers 5, ``AutoTokenizer`` on a directory whose config.json says ``qwen2``
    builds a byte-level Qwen2 tokenizer and ignores a custom ``tokenizer.json``. Where a
    ``tokenizer.json`` exists we therefore load it directly with ``PreTrainedTokenizerFast``,
    which reads the same file (and tokenizer_config.json's special tokens) for real checkpoints
    too; otherwise we fall back to ``AutoTokenizer`` on local files only.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: tokenizer directory does not exist")
    return AutoTokenizer.from_pretrained(
        path, local_files_only=True, trust_remote_code=trust_remote_code
    )


def same_vocabulary(actor_tok, reward_tok) -> bool:
    """True when both tokenizers map every token to the same id (needed to stream chunks)."""
    return actor_tok.get_vocab() == reward_tok.get_vocab()
