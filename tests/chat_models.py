"""A tiny verified chat checkpoint for the tests that serve one: a random 2-layer dense base under the 2,048-id BPE,
grown by the four chat markers (chapter 16's `chat_start`), with its tokenizer.json in the folder above it."""
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


def chat_checkpoint(root: Path, max_seq_len: int = 128, seed: int = 0) -> Path:
    "A verified chat checkpoint of a random model with a context of `max_seq_len` ids, its tokenizer.json in `root`."
    TOK.tok.save(str(root / "tokenizer.json"))
    config = DenseConfig(vocab_size=BASE.vocab_size, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=64,
                         max_seq_len=max_seq_len)
    torch.manual_seed(seed)
    model = build_model(config)
    rows = sft_rows(TOK, [{"id": "a", "messages": [{"role": "user", "content": "Allegra"}]}], 64)
    base = save_checkpoint(root / "base", model, torch.optim.AdamW(model.parameters()), SFTLoader(rows, 1, TOK.bos_id),
                           0, "full", {"model": to_dict(config)})
    return chat_start(config, base, DenseConfig(**{**to_dict(config), "vocab_size": TOK.vocab_size}), root / "start")
