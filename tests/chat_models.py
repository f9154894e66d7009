"""Tiny verified checkpoints for the tests that serve one: a random 2-layer dense base under the 2,048-id BPE (its plain
tokenizer saved as base.json), and that base grown by the four chat markers (chapter 16's `chat_start`), with its chat
tokenizer.json in the folder above it."""
from pathlib import Path

import torch

from openpretrain.core import to_dict
from openpretrain.models.dense import DenseConfig
from openpretrain.models.registry import build_model
from openpretrain.chat import chat_tokenizer
from openpretrain.posttrain.sft import SFTLoader, chat_start, sft_rows
from openpretrain.tokenization import load_tokenizer
from openpretrain.training.checkpoint import save_checkpoint

BASE = load_tokenizer("bpe-bal-2k")
TOK = chat_tokenizer(BASE)


def _config(max_seq_len: int) -> DenseConfig:
    return DenseConfig(vocab_size=BASE.vocab_size, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=64,
                       max_seq_len=max_seq_len)


def base_checkpoint(root: Path, max_seq_len: int = 128, seed: int = 0) -> Path:
    "A verified base checkpoint (`root`/base) of a random model with a context of `max_seq_len` ids, its tokenizer in base.json."
    BASE.tok.save(str(root / "base.json"))
    config = _config(max_seq_len)
    torch.manual_seed(seed)
    model = build_model(config)
    rows = sft_rows(TOK, [{"id": "a", "messages": [{"role": "user", "content": "Allegra"}]}], 64)
    return save_checkpoint(root / "base", model, torch.optim.AdamW(model.parameters()), SFTLoader(rows, 1, TOK.bos_id),
                           0, "full", {"model": to_dict(config)})


def chat_checkpoint(root: Path, max_seq_len: int = 128, seed: int = 0) -> Path:
    "A verified chat checkpoint of a random model with a context of `max_seq_len` ids, its tokenizer.json in `root`."
    TOK.tok.save(str(root / "tokenizer.json"))
    config = _config(max_seq_len)
    base = base_checkpoint(root, max_seq_len, seed)
    return chat_start(config, base, DenseConfig(**{**to_dict(config), "vocab_size": TOK.vocab_size}), root / "start")
