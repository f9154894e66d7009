"""Supervised fine-tuning: the chat template and its targets, rows and the resumable loader, the loss normalised over
the global batch (accumulation changes nothing), the grown start, the transformers round trip, the licence and
decontamination gates, and the CLI's one-line refusals."""
import subprocess
import sys

import pytest
import torch

from tiny_runs import small_preset

from openpretrain.core import ConfigError, to_dict
from openpretrain.models.registry import build_model
from openpretrain.chat import CHAT_TOKENS, END, chat_ids, chat_tokenizer, render
from openpretrain.posttrain.sft import (SFTConfig, SFTLoader, chat_start, export_chat, finetune, sft_data, sft_preset, sft_rows,
                                        source_licences)
from openpretrain.tokenization import load_tokenizer
from openpretrain.training.checkpoint import CheckpointError, load_model, save_checkpoint
from openpretrain.training.plan import plan
from openpretrain.training.trainer import read_metrics

TOK = chat_tokenizer(load_tokenizer("bpe-bal-2k"))


def chat(i: int) -> dict:
    "A conversation whose reply length grows with i: micro-batches then hold different numbers of targets."
    return {"id": f"c{i:03d}", "source": "test", "messages": [
        {"role": "system", "content": "Du bist ein Übersetzer."},
        {"role": "user", "content": f"Übersetze ins Rumantsch: Alle Menschen sind frei {i}."},
        {"role": "assistant", "content": "Tut ils umans naschan libers " * (1 + i % 5)}]}


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    "A verified checkpoint of the small preset's (random) base model."
    pl = plan(small_preset())
    model = build_model(pl.model)
    rows = sft_rows(TOK, [chat(0)], 128)
    return save_checkpoint(tmp_path_factory.mktemp("base"), model, torch.optim.AdamW(model.parameters()),
                           SFTLoader(rows, 1, TOK.bos_id), 0, "full", {"model": to_dict(pl.model)})


def test_targets_are_the_assistant_content_and_its_end_marker_only():
    ids, target = render(TOK, chat(2)["messages"])
    marker = chat_ids(TOK)
    assert ids[0] == TOK.bos_id and [i for i in ids if i in marker.values()] == [
        marker["<|system|>"], marker[END], marker["<|user|>"], marker[END], marker["<|assistant|>"], marker[END]]
    assert TOK.tok.decode([i for i, t in zip(ids, target) if t]) == chat(2)["messages"][2]["content"]
    assert target[-1] and ids[-1] == marker[END] and sum(target) == len(TOK.encode(chat(2)["messages"][2]["content"])) + 1


def test_markers_are_new_ids_and_typed_markers_stay_text():
    assert [TOK.tok.token_to_id(t) for t in CHAT_TOKENS] == [2048, 2049, 2050, 2051] and TOK.vocab_size == 2052
    assert not set(TOK.encode("<|user|> <|end|>")) & set(chat_ids(TOK).values())
    with pytest.raises(ConfigError, match="already holds a chat marker"):
        chat_tokenizer(TOK)
    with pytest.raises(ValueError, match="turn 0"):
        render(TOK, [{"role": "tool", "content": "x"}])


def test_rows_pack_whole_conversations_and_drop_the_ones_longer_than_a_row():
    convs = [chat(i) for i in range(20)] + [{"id": "long", "messages": [{"role": "user", "content": "Wort " * 200},
                                                                      {"role": "assistant", "content": "x"}]}]
    packed, single = sft_rows(TOK, convs, 128), sft_rows(TOK, convs, 128, pack=False)
    assert packed.dropped == single.dropped == ["long"] and packed.conversations == 20 == len(single.ids)
    assert packed.target.sum() == single.target.sum() and len(packed.ids) < len(single.ids)
    assert (packed.ids[:, 0] == TOK.bos_id).all() and packed.ids.shape[1] == 129
    starts = (packed.ids == TOK.bos_id).sum()
    assert starts == 20, "every conversation starts with its own BoS, none is split across rows"


def test_the_loader_shards_resumes_and_refuses_other_rows():
    rows = sft_rows(TOK, [chat(i) for i in range(30)], 128, pack=False)
    one = SFTLoader(rows, 2, TOK.bos_id, seed=3)
    ranks = [SFTLoader(rows, 1, TOK.bos_id, rank=r, world_size=2, seed=3) for r in range(2)]
    for _ in range(20):                                      # past the first epoch
        whole = one.next_batch().input_ids
        assert torch.equal(whole, torch.cat([r.next_batch().input_ids for r in ranks]))
    resumed = SFTLoader(rows, 2, TOK.bos_id, seed=3)
    resumed.load_state_dict(one.state_dict())
    assert torch.equal(resumed.next_batch().input_ids, one.next_batch().input_ids)
    other = sft_rows(TOK, [chat(i) for i in range(31)], 128, pack=False)
    with pytest.raises(CheckpointError, match="other SFT rows"):
        SFTLoader(other, 2, TOK.bos_id).load_state_dict(one.state_dict())


def test_accumulation_does_not_change_the_loss_or_the_weights(tmp_path, base_checkpoint):
    convs = [chat(i) for i in range(48)]
    finals = {mb: finetune(small_preset(micro_batch=mb), base_checkpoint, tmp_path / f"mb{mb}", convs) for mb in (8, 2)}
    losses = {mb: [r["loss"] for r in read_metrics(tmp_path / f"mb{mb}" / "run" / "metrics.jsonl")] for mb in finals}
    assert len(losses[8]) >= 2 and losses[8] == pytest.approx(losses[2], rel=1e-5)
    config = plan(sft_preset(small_preset(), tmp_path / "mb8" / "tokenizer.json", TOK.vocab_size, 1)).model
    a, b = (load_model(finals[mb], config).state_dict() for mb in (8, 2))
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    # the alternative the public trainer avoids: a mean per micro-batch weighs them by 1 / their own target count
    loader = SFTLoader(sft_rows(TOK, convs, 128), 2, TOK.bos_id)
    counts = [loader.next_batch().loss_mask.sum().item() for _ in range(4)]
    assert len(set(counts)) > 1, "the micro-batches differ in targets, so a per-micro-batch mean would differ"


def test_a_resumed_run_over_other_data_is_refused(tmp_path, base_checkpoint):
    p = small_preset()
    finetune(p, base_checkpoint, tmp_path / "run", [chat(i) for i in range(48)])
    with pytest.raises(CheckpointError, match="other SFT rows"):
        finetune(p, base_checkpoint, tmp_path / "run", [chat(i) for i in range(49)])


def test_the_grown_start_keeps_every_old_score_and_averages_the_new_rows(tmp_path, base_checkpoint):
    p = small_preset()
    base_config = plan(p).model
    grown_config = type(base_config)(**{**to_dict(base_config), "vocab_size": TOK.vocab_size})
    base, grown = load_model(base_checkpoint, base_config), load_model(chat_start(base_config, base_checkpoint, grown_config, tmp_path), grown_config)
    x = torch.randint(3, 2048, (2, 16))
    with torch.no_grad():
        assert torch.allclose(grown(x)[..., :2048], base(x))
    assert torch.allclose(grown.embed_tokens.weight[2048:], base.embed_tokens.weight.mean(0).expand(4, -1))
    assert chat_start(base_config, base_checkpoint, grown_config, tmp_path) == chat_start(base_config, base_checkpoint, grown_config, tmp_path)


def test_the_export_carries_the_template_and_generates_as_we_do(tmp_path, base_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from openpretrain.models.common import generate
    final = finetune(small_preset(), base_checkpoint, tmp_path / "run", [chat(i) for i in range(48)])
    config = plan(sft_preset(small_preset(), tmp_path / "run" / "tokenizer.json", TOK.vocab_size, 1)).model
    out = export_chat(final, TOK, tmp_path / "hf")
    hf_tok, hf_model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
    messages = chat(3)["messages"][:2]
    ids = render(TOK, messages, add_generation_prompt=True)[0]
    assert hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False) == ids
    assert hf_tok.eos_token == END and hf_tok.convert_tokens_to_ids(END) == chat_ids(TOK)[END]
    theirs = hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=chat_ids(TOK)[END],
                               pad_token_id=hf_tok.pad_token_id)[0, len(ids):].tolist()
    mine = generate(load_model(final, config), torch.tensor([ids]), 12, eos_id=chat_ids(TOK)[END])[0, len(ids):].tolist()
    assert theirs == mine[:len(theirs)]
    with pytest.raises(Exception, match="unknown role"):
        hf_tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_the_licence_gate_excludes_the_copyleft_source_and_unknown_sources():
    table = source_licences(["udhr", "firefox-de-rm"]).set_index("source")
    assert table.loc["udhr", "keep"] and not table.loc["firefox-de-rm", "keep"]
    assert "share-alike" in table.loc["firefox-de-rm", "reason"]
    with pytest.raises(ConfigError, match="unknown"):
        source_licences(["wikipedia"])


def test_no_test_article_is_trained_on_in_any_language():
    c = SFTConfig(sources=["udhr"], versions=["deu_1996", "roh_rumgr", "fra"], test_articles=[29, 30])
    train, test, table = sft_data(c, TOK)
    assert set(test.article) == {29, 30} and {(r.src, r.tgt) for r in test.itertuples()} == {("deu_1996", "roh_rumgr"), ("roh_rumgr", "deu_1996")}
    assert not any(x["id"].startswith(("udhr-29.", "udhr-30.")) for x in train)
    assert table.loc[0, "after licence"] == table.loc[0, "candidates"] >= len(train) > 0


def test_the_cli_refuses_a_missing_start_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "openpretrain", "sft", "--preset", "tiny", "--from", str(tmp_path / "none"),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("openpretrain sft: ")


def test_a_run_resumed_over_another_base_is_refused(tmp_path, base_checkpoint):
    p = small_preset()
    finetune(p, base_checkpoint, tmp_path / "run", [chat(i) for i in range(48)])
    other = build_model(plan(p).model)
    torch.nn.init.normal_(other.embed_tokens.weight)
    rows = sft_rows(TOK, [chat(0)], 128)
    second = save_checkpoint(tmp_path / "other", other, torch.optim.AdamW(other.parameters()), SFTLoader(rows, 1, TOK.bos_id),
                             0, "full", {"model": to_dict(plan(p).model)})
    with pytest.raises(CheckpointError, match="started from"):
        finetune(p, second, tmp_path / "run", [chat(i) for i in range(48)])


@pytest.mark.parametrize("damage", ["truncated", "unknown preset"])
def test_the_cli_refuses_a_damaged_start_or_an_unknown_preset_in_one_line(tmp_path, base_checkpoint, damage):
    import shutil
    start = tmp_path / "start"
    shutil.copytree(base_checkpoint, start)
    preset = "tiny"
    if damage == "truncated":
        weights = start / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        preset = "no-such-preset"
    r = subprocess.run([sys.executable, "-m", "openpretrain", "sft", "--preset", preset, "--from", str(start),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("openpretrain sft: ")
    assert not (tmp_path / "out").exists(), "nothing is written when the run cannot start"


def test_a_batch_larger_than_the_rows_is_refused_naming_the_knob_before_anything_is_written(tmp_path):
    convs = [chat(i) for i in range(48)]
    rows = len(sft_rows(TOK, convs, 128).ids)
    with pytest.raises(ConfigError, match=rf"sft.batch_size 1,000,000,000 is more than the {rows} rows") as e:
        finetune(small_preset(batch_size=10**9), None, tmp_path / "out", convs, TOK)
    assert e.value.field == "sft.batch_size" and not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="sft.batch_size"):
        finetune(small_preset(batch_size=rows + 1, epochs=4), None, tmp_path / "out", convs, TOK)   # epochs do not lift it


def test_a_seq_len_beyond_the_models_context_is_refused_before_any_row_is_padded(tmp_path, monkeypatch):
    import openpretrain.posttrain.sft as sft
    def padded(*args, **kw):
        raise AssertionError("rows were built: every one padded to sft.seq_len + 1 ids")
    monkeypatch.setattr(sft, "sft_rows", padded)
    with pytest.raises(ConfigError, match="sft.seq_len 1,000,000,000 exceeds the model's context 128") as e:
        finetune(small_preset(seq_len=10**9), None, tmp_path / "out", [chat(0)], TOK)
    assert e.value.field == "sft.seq_len" and not (tmp_path / "out").exists()
