"""The preset the SFT and preference tests train: a 2-layer dense model at 128 tokens under the 2,048-id BPE."""
import copy

from openpretrain.core import Preset, load_preset


def small_preset(micro_batch: int = 8, **sft) -> Preset:
    "The tiny preset shrunk to a 2-layer, width-32 model at 128 tokens; `sft` overrides its sft section (lr 1e-3, batch 8)."
    base = load_preset("tiny")
    raw = copy.deepcopy(base.raw)
    raw["seed"], raw["device"] = 0, "cpu"
    raw["tokenizer"].update(name="bpe-bal-2k", vocab_size=2048)
    raw["model"].update(vocab_size=2048, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=64, max_seq_len=128)
    raw["data"]["seq_len"] = 128
    raw["train"].update(micro_batch=micro_batch, precision="fp32", checkpoint_every=100, keep_last=1, milestones=[],
                        tensorboard=False)
    raw["sft"] = {**raw["sft"], "lr": 1e-3, "batch_size": 8, "seq_len": 128, "epochs": 1, **sft}
    return Preset(name="tiny", path=base.path, raw=raw)
