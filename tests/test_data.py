"""Curriculum specs, token files, packing, exact accounting and the resumable rank-sharded loader."""
import copy
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from openpretrain.core import ConfigError, configs_dir, from_dict
from openpretrain.corpus import load_embedded
from openpretrain.tokenization import load_tokenizer
from openpretrain.training.curriculum import Curriculum, load_curriculum, validate
from openpretrain.training.data import CurriculumExhausted, TokenLoader, accounting_table, pack_rows, row_counts
from openpretrain.training.plan import plan, token_loader

MB = 16


def tiny_embedded() -> str:
    "The tiny preset reading the embedded corpus, whether or not a report run has left compliance output behind."
    text = (configs_dir() / "tiny.yaml").read_text()
    assert "  input: auto" in text
    path = Path(tempfile.mkdtemp()) / "tiny.yaml"
    path.write_text(text.replace("  input: auto", "  input: embedded"))
    return str(path)


TINY = plan(tiny_embedded())
TOKENIZER = load_tokenizer(TINY.tokenizer)


@pytest.fixture(scope="module")
def loader():
    return fresh()


@pytest.fixture(scope="module")
def tok():
    return TOKENIZER


def fresh(micro_batch: int = MB, rank: int = 0, world_size: int = 1, label_mask=None) -> TokenLoader:
    "A new loader over the tiny plan (the plan's loader with another micro-batch)."
    from dataclasses import replace
    return token_loader(replace(TINY, train=replace(TINY.train, micro_batch=micro_batch)), TOKENIZER, rank, world_size,
                        label_mask)


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"stages\[0\].*unknown key 'weigth'"):
        from_dict(Curriculum, {"name": "x", "stages": [{"name": "s", "tokens": 1, "weigth": 1}]})


@pytest.mark.parametrize("edit,message", [
    (lambda c: setattr(c.stages[0].sources[0], "weight", 0.9), "sum to 1"),
    (lambda c: setattr(c.stages[0], "tokens", 5), r"stages\[0\] \(stage-1\)\.tokens = 5 but end − start"),
    (lambda c: setattr(c.stages[1], "start", 1000), "previous stage ends at"),
    (lambda c: setattr(c.stages[0].sources[1], "weight", None), "every source or for none"),
    (lambda c: setattr(c.stages[0].sources[0], "select", None), r"sources\[0\] \(fortunes-en\)\.select"),
    (lambda c: setattr(c.stages[1].sources[2], "max_documents", 7), r"\(udhr\): name reused"),
])
def test_bad_tiny_spec_fails_naming_the_key(edit, message):
    c = copy.deepcopy(load_curriculum("tiny"))
    edit(c)
    with pytest.raises(ConfigError, match=message):
        validate(c)


def test_soofi_effective_must_equal_raw_times_epochs():
    c = copy.deepcopy(load_curriculum("soofi-30b-a3b"))
    c.stages[0].sources[0].effective *= 2
    with pytest.raises(ConfigError, match=r"effective = .* but raw × epochs"):
        validate(c)


def test_soofi_phase_budgets_match_table_2_token_counts():
    p1, p2, p3 = load_curriculum("soofi-30b-a3b").stages
    assert p1.iterations * p1.tokens_per_iteration == 19_999_984_975_872  # Table 2 / §2.1, as printed
    assert p2.iterations * p2.tokens_per_iteration == 4_999_996_243_968 + 1_575_128_924_160  # main + constant
    assert p2.discarded_iterations == 1_067_920 - 1_056_000                    # final annealing: 1,056,000 → 1,067,920
    assert p3.iterations * p3.tokens_per_iteration == 2_000 * 1_048_576 * 48


def test_apertus_stages_cover_15t_contiguously():
    for name, n in (("apertus-70b", 5), ("apertus-8b", 4)):
        stages = load_curriculum(name).stages
        assert len(stages) == n and stages[0].start == 0 and stages[-1].end == 15_000
        assert all(a.end == b.start for a, b in zip(stages, stages[1:]))


def test_row_counts_sum_exactly_and_follow_weights():
    counts = row_counts({"a": 0.3, "b": 0.25, "c": 0.2, "d": 0.15, "e": 0.1}, 1537)
    assert sum(counts.values()) == 1537
    assert all(abs(counts[n] - w * 1537) < 1 for n, w in {"a": 0.3, "b": 0.25, "c": 0.2, "d": 0.15, "e": 0.1}.items())


def test_token_files_decode_back_to_the_selected_documents(loader, tok):
    pool = loader.pools["romansh"]
    corpus = load_embedded().to_pandas()
    texts = corpus[corpus.source == "firefox-esr-l10n-rm"].text.head(60).tolist()  # the spec: max_documents 60
    docs = pool.documents()
    assert len(docs) == len(texts)
    for doc, text in zip(docs, texts):
        assert doc[0] == tok.bos_id and doc[-1] == tok.eos_id
        assert tok.tok.decode(doc[1:-1].tolist(), skip_special_tokens=False) == text


def test_packed_row_is_the_pool_stream_and_documents_split_at_bod(loader, tok):
    pool = loader.pools["kjv"].tokens
    rows = np.stack([pool[j * 256:(j + 1) * 256 + 1] for j in range(3)])
    b = pack_rows(rows, tok.bos_id, tok.eos_id)
    assert torch.equal(b.input_ids[:, 1:], b.labels[:, :-1])
    assert torch.equal(b.labels[:-1, -1], b.input_ids[1:, 0])  # consecutive rows overlap by one token
    for r in range(3):  # decode each segment: it is one piece of one document, starting at a BoD
        seg = b.doc_ids[r]
        for d in seg.unique().tolist():
            ids = b.input_ids[r][seg == d].tolist()
            assert tok.bos_id not in ids[1:] and (d == 0 or ids[0] == tok.bos_id)


def megatron_loss_mask(data: torch.Tensor, eod_token: int, eod_mask_loss: bool = True) -> torch.Tensor:
    "The loss-mask lines of Megatron-LM's `_get_ltor_masks_and_position_ids` (swiss-ai/Megatron-LM, gpt_dataset.py)."
    loss_mask = torch.ones(data.size(), dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    return loss_mask


def test_loss_mask_is_megatrons_eod_mask_loss_on_the_inputs(tok):
    b = fresh().next_batch()                         # no Goldfish hook given: the EoD rule alone
    expected = torch.stack([megatron_loss_mask(tokens, tok.eos_id) for tokens in b.input_ids]) == 1.0
    assert torch.equal(b.loss_mask, expected)
    assert b.loss_mask[b.labels == tok.eos_id].all() and (b.labels == tok.eos_id).any()   # EoD is learnt
    assert not b.loss_mask[b.input_ids == tok.eos_id].any()                               # the next BoD is not


def test_a_model_can_only_end_a_document_if_eod_is_a_trained_target(tok):
    ids = np.array([[tok.bos_id, 11, 12, tok.eos_id, tok.bos_id, 21, 22, 23, tok.eos_id, tok.bos_id]])
    b = pack_rows(ids, tok.bos_id, tok.eos_id)
    assert b.labels[0][b.loss_mask[0]].tolist() == [11, 12, tok.eos_id, 21, 22, 23, tok.eos_id]


def test_label_mask_hook_is_anded_into_the_loss_mask(tok):
    drop_even = lambda labels: labels % 2 == 1
    b = fresh(label_mask=drop_even).next_batch()
    assert not b.loss_mask[b.labels % 2 == 0].any()


def test_accounting_equals_tokens_yielded_per_stage_and_source(loader):
    table = accounting_table(loader)
    ld = fresh()
    yielded = {}
    while ld.tokens_seen < ld.total_tokens:
        stage = ld.curriculum.stages[ld.stage_index].name
        b = ld.next_batch()
        for s in b.source_ids.tolist():
            key = (stage, ld.source_names[s])
            yielded[key] = yielded.get(key, 0) + int(b.labels.numel() // b.labels.shape[0])
    expected = {(r.stage, r.source): int(r["consumed tokens"]) for _, r in table.iterrows()}
    assert yielded == expected
    assert sum(yielded.values()) == ld.tokens_seen == 524_288  # the tiny curriculum's two budgets
    raw = {r.source: int(r["raw tokens"]) for _, r in table.iterrows()}
    assert raw == {n: len(p.tokens) for n, p in loader.pools.items()}


def test_stage_switches_by_tokens_consumed(loader):
    ld = fresh()
    ld.load_state_dict({**ld.state_dict(), "tokens_seen": 393_216, "micro_step": 0})
    assert ld.stage_index == 1
    stage2 = {s.name for s in ld.curriculum.stages[1].sources}
    assert {ld.source_names[s] for s in ld.next_batch().source_ids.tolist()} <= stage2


def test_resume_from_state_dict_reproduces_the_batches():
    a = fresh(micro_batch=4)
    [a.next_batch() for _ in range(5)]
    cont = [a.next_batch() for _ in range(3)]
    b = fresh(micro_batch=4)
    [b.next_batch() for _ in range(5)]
    state = json.loads(json.dumps(b.state_dict()))
    c = fresh(micro_batch=4)
    c.load_state_dict(state)
    for x, y in zip(cont, [c.next_batch() for _ in range(3)]):
        for f in ("input_ids", "labels", "loss_mask", "doc_ids", "source_ids"):
            assert torch.equal(getattr(x, f), getattr(y, f))


def test_two_ranks_are_disjoint_and_together_equal_one_rank():
    one = [b for ld in [fresh(micro_batch=8)] for b in (ld.next_batch(), ld.next_batch())]
    ranks = [fresh(micro_batch=4, rank=r, world_size=2) for r in (0, 1)]
    for b in one:
        parts = [ld.next_batch() for ld in ranks]
        assert torch.equal(torch.cat([p.input_ids for p in parts]), b.input_ids)
    assert ranks[0].tokens_seen == ranks[1].tokens_seen == 2 * 8 * 256


def test_batch_doubling_reads_the_same_rows_with_more_micro_batches():
    small = fresh(micro_batch=4)
    rows = torch.cat([small.next_batch().input_ids for _ in range(4)])  # 2 steps of 8 rows, then 1 step of 16
    big = fresh(micro_batch=16)
    assert torch.equal(rows, big.next_batch().input_ids)


def test_seed_changes_the_order_but_not_the_accounting(loader):
    other = TokenLoader(loader.curriculum, loader.pools, 256, MB, loader.bod, loader.eod, seed=1)
    assert not torch.equal(fresh().next_batch().input_ids, other.next_batch().input_ids)
    assert accounting_table(other).equals(accounting_table(loader))


def test_loader_raises_when_the_curriculum_is_exhausted():
    ld = fresh()
    ld.load_state_dict({**ld.state_dict(), "tokens_seen": 524_288})
    with pytest.raises(CurriculumExhausted, match="524,288 tokens"):
        ld.next_batch()


def test_state_of_another_curriculum_is_rejected():
    ld = fresh()
    with pytest.raises(ValueError, match="seed"):
        ld.load_state_dict({**ld.state_dict(), "seed": 7})


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid", "gpu-1", "apertus-8b", "apertus-70b", "soofi-30b-a3b"])
def test_every_preset_names_a_valid_curriculum(preset):
    from openpretrain.core import load_preset
    from openpretrain.training.data import DataConfig
    config = load_preset(preset).section("data", DataConfig)
    stages = load_curriculum(config.curriculum).stages
    assert stages and all(st.tokens > 0 and st.sources for st in stages)


def test_a_pool_shared_by_two_stages_is_not_reread_before_it_is_used_up(loader):
    ld = fresh(micro_batch=64)
    udhr = ld.source_names.index("udhr")
    rows = []
    while ld.tokens_seen < ld.total_tokens:
        b = ld.next_batch()
        rows += [tuple(r) for r in b.input_ids[b.source_ids == udhr].tolist()]
    assert len(rows) * 256 < len(loader.pools["udhr"].tokens)  # less than one epoch over both stages
    assert len(set(rows)) == len(rows)


def test_compliance_kept_jsonl_is_tokenized_by_source(tmp_path, tok):
    from datatrove.data import Document
    from datatrove.pipeline.writers import JsonlWriter
    from openpretrain.tokenization import TokenizerConfig
    from openpretrain.training.curriculum import SourceSpec, StageSpec
    from openpretrain.training.data import DataConfig, TokenPool, tokenize_curriculum
    docs = [Document(text=f"Allegra {i}! Quai è in text rumantsch.", id=f"rm{i}",
                     metadata={"source": "firefox-esr-l10n-rm", "language": "roh"}) for i in range(5)]
    docs += [Document(text="Hello there.", id="en0", metadata={"source": "fortunes", "language": "eng"})]
    with JsonlWriter(str(tmp_path / "kept")) as w:  # the writer the compliance pipeline keeps documents with
        for d in docs:
            w.write(d)
    c = validate(Curriculum(name="kept", stages=[StageSpec(name="s", tokens=1024, sources=[
        SourceSpec(name="rm", select={"source": ["firefox-esr-l10n-rm"]}, weight=1.0)])]))
    out = tokenize_curriculum(c, DataConfig(input=str(tmp_path / "kept"), seq_len=256),
                              TokenizerConfig(name="bpe-bal-8k", vocab_size=8192), token_dir=tmp_path / "tokens")
    assert out.is_relative_to(tmp_path / "tokens")
    pool = TokenPool.open(out / "rm")
    assert [tok.tok.decode(d[1:-1].tolist()) for d in pool.documents()] == [d.text for d in docs[:5]]


def test_auto_input_reads_the_compliance_output_of_this_runs_root_never_the_checkouts(tmp_path, monkeypatch):
    from openpretrain.training.data import DataConfig, input_documents
    kept = tmp_path / "run" / "tiny" / "compliance" / "kept"
    kept.mkdir(parents=True)
    (kept / "00000.jsonl.gz").write_bytes(b"")
    monkeypatch.setenv("OPENPRETRAIN_OUTPUTS", str(tmp_path / "run"))
    assert input_documents(DataConfig(), "tiny") == (str(kept), "jsonl")
    monkeypatch.setenv("OPENPRETRAIN_OUTPUTS", str(tmp_path / "fresh"))   # a root whose 04a has not run
    assert input_documents(DataConfig(), "tiny")[1] == "parquet"          # the embedded corpus


# --- the token cache is what it claims to be (issue 17, causes 11 and 12) ------------------------------------

def one_source_curriculum(name: str = "kept", source: str = "fortunes-de") -> Curriculum:
    "A one-stage curriculum reading one embedded source into the pool `de`."
    from openpretrain.training.curriculum import SourceSpec, StageSpec
    return validate(Curriculum(name=name, stages=[StageSpec(name="s", tokens=1024, sources=[
        SourceSpec(name="de", select={"source": [source]}, weight=1.0)])]))


def tokenize_into(tmp_path, curriculum=None, tokenizer=None):
    from openpretrain.tokenization import TokenizerConfig
    from openpretrain.training.data import DataConfig, tokenize_curriculum
    return tokenize_curriculum(curriculum or one_source_curriculum(), DataConfig(input="embedded", seq_len=256),
                               tokenizer or TokenizerConfig(name="bpe-bal-8k", vocab_size=8192),
                               token_dir=tmp_path / "tokens")


def test_a_document_with_literal_bod_text_stays_one_document_in_the_token_files(tmp_path, tok):
    from openpretrain.training.data import TokenPool
    pool = TokenPool.open(tokenize_into(tmp_path) / "de")
    docs = pool.documents()
    assert all(d[0] == tok.bos_id and d[-1] == tok.eos_id for d in docs)
    assert all(tok.bos_id not in d[1:] and tok.eos_id not in d[:-1] for d in docs)    # no split inside a document
    assert any("<s>" in tok.tok.decode(d[1:-1].tolist()) for d in docs)                # the strike-through is text


def test_a_token_file_cut_in_half_is_tokenized_again_not_trained_on(tmp_path, capsys):
    from openpretrain.training.data import TokenPool
    out = tokenize_into(tmp_path)
    whole = TokenPool.open(out / "de").tokens.copy()
    part = next((out / "de").glob("*.ds"))
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    assert tokenize_into(tmp_path) == out and "tokenizing again" in capsys.readouterr().err
    assert np.array_equal(TokenPool.open(out / "de").tokens, whole)


def test_a_deleted_source_folder_is_tokenized_again(tmp_path, capsys):
    import shutil
    out = tokenize_into(tmp_path)
    shutil.rmtree(out / "de")
    assert (tokenize_into(tmp_path) / "de").is_dir() and "de/00000.ds is missing" in capsys.readouterr().err


def test_an_odd_sized_token_file_is_refused_naming_it(tmp_path):
    from openpretrain.training.data import TokenCacheError, TokenPool
    out = tokenize_into(tmp_path)
    part = next((out / "de").glob("*.ds"))
    part.write_bytes(part.read_bytes() + b"\x01")                       # 2-byte ids plus one stray byte
    with pytest.raises(TokenCacheError, match=r"00000\.ds: .* not whole ids"):
        TokenPool.open(out / "de")


def test_a_replaced_tokenizer_file_of_the_same_name_and_size_gets_its_own_token_folder(tmp_path, monkeypatch):
    import openpretrain.tokenization as T
    first = tokenize_into(tmp_path)
    ours = T.our_tokenizers_dir()
    other = json.loads((ours / "bpe-bal-8k" / "tokenizer.json").read_text())
    vocab = other["model"]["vocab"]
    a, b = (next(p for p, i in vocab.items() if i == k) for k in (500, 501))
    vocab[a], vocab[b] = 501, 500                                        # same name, same size, other ids
    (tmp_path / "ours" / "bpe-bal-8k").mkdir(parents=True)
    (tmp_path / "ours" / "bpe-bal-8k" / "tokenizer.json").write_text(json.dumps(other))
    monkeypatch.setattr(T, "our_tokenizers_dir", lambda: tmp_path / "ours")
    assert tokenize_into(tmp_path) != first


def test_a_token_folder_a_writer_left_without_its_record_is_never_read(tmp_path):
    from openpretrain.training.data import TokenPool
    out = tokenize_into(tmp_path)
    (out / "done.json").unlink()                                 # a concurrent writer's folder before its record:
    for f in (out / "de").iterdir():                             # its files opened, nothing written yet, its task
        f.write_bytes(b"" if f.suffix != ".metadata" else f.read_bytes())   # already marked complete in its logs
    assert (out / "logs" / "completions" / "00000").is_file()
    assert len(TokenPool.open(tokenize_into(tmp_path) / "de").tokens) > 0


CONCURRENT = """
import os, sys, time
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_data import one_source_curriculum, tokenize_into
tmp = Path({tmp!r})
(tmp / f"ready-{{os.getpid()}}").touch()
while len(list(tmp.glob("ready-*"))) < 2:          # both start tokenizing at the same moment
    time.sleep(0.01)
print(tokenize_into(tmp, one_source_curriculum("bible", "bible-kjv-text")))
"""


def test_two_cold_tokenizations_at_once_both_succeed_with_one_folder(tmp_path):
    import os
    import subprocess
    import sys
    script = tmp_path / "cold.py"
    script.write_text(CONCURRENT.format(tests=str(Path(__file__).parent), tmp=str(tmp_path)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert len({o.strip() for o, _ in outs}) == 1 and not list((tmp_path / "tokens").glob(".*tmp*"))
