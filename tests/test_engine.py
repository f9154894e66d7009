"""Chapter 10d's engine on a dense and a hybrid model: batched greedy replies equal one-at-a-time ones, a reply ends at
its first stop id, the context rule comes from the registry (none for the hybrid), n samples and the seed rule equal
chapter 05a's `generate` on the same rows, `stream` equals `generate`, and the test-time step sampler runs on a hybrid
policy; `ChatModel.load` reads the config the checkpoint records."""
import dataclasses

import pytest
import torch

from chat_models import TOK, chat_checkpoint
from openpretrain.engine import ChatModel, Completion, batches, check_room, generate, room, stream
from openpretrain.evaluation.strategies import solution_prompt
from openpretrain.evaluation.testbed import problems
from openpretrain.evaluation import test_time as tt
from openpretrain.models import common
from openpretrain.models.dense import DenseConfig
from openpretrain.models.hybrid import HybridConfig
from openpretrain.models.registry import build_model
from openpretrain.training.checkpoint import CheckpointError

DENSE = DenseConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=64, max_seq_len=40)
HYBRID = HybridConfig(vocab_size=97, d_model=32, pattern="M*E-ME", n_heads=4, n_kv_heads=2, head_dim=8,
                      mamba_heads=4, mamba_head_dim=8, mamba_groups=2, mamba_state=8, mamba_chunk=8,
                      n_experts=8, top_k=3, expert_hidden=16, shared_hidden=24, mlp_hidden=40)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11, 12], [13, 14, 15], [16, 17, 18, 19, 20], [21]]


def model(config):
    torch.manual_seed(0)
    return build_model(config).eval()


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def lm(request):
    return model(DENSE if request.param == "dense" else HYBRID)


def reference(lm, prompt: list[int], budget: int, stop: int, **sampling) -> list[list[int]]:
    "Chapter 05a's `generate` on the prompt's rows, each cut after its first `stop` (the engine keeps the stop id)."
    n = sampling.pop("n", 1)
    rows = common.generate(lm, torch.tensor([prompt]).expand(n, -1), budget, eos_id=stop, **sampling)[:, len(prompt):]
    return [r[:r.index(stop) + 1] if stop in r else r for r in rows.tolist()]


def test_batched_greedy_replies_equal_one_at_a_time(lm):
    together = generate(lm, PROMPTS, 12, stop_ids=(5,), batch_size=2)
    assert together == [generate(lm, [p], 12, stop_ids=(5,))[0] for p in PROMPTS]
    assert [[c.ids] for (c,) in together] == [[reference(lm, p, 12, 5)[0]] for p in PROMPTS]


def test_a_reply_ends_at_its_first_stop_id_and_keeps_it(lm):
    free = generate(lm, PROMPTS, 10)
    stop = free[0][0].ids[3]                                       # an id the first reply emits, at step 4 or before
    cut = generate(lm, PROMPTS, 10, stop_ids=(stop,))
    for (a,), (b,) in zip(free, cut):
        end = a.ids.index(stop) + 1 if stop in a.ids else None
        assert b == (Completion(a.ids[:end], "stop") if end else Completion(a.ids, "length"))
        assert b.body == (a.ids[:end - 1] if end else a.ids)


def test_n_samples_and_the_seed_rule_equal_generate_on_the_same_rows(lm):
    "Batch k of a call draws from a generator seeded seed + k; a prompt's n samples are n rows of one batch."
    got = generate(lm, [[1, 2, 3], [4, 5]], 8, temperature=1.0, top_p=0.9, n=3, stop_ids=(9,), seed=40)
    assert [c.ids for c in got[0]] == reference(lm, [1, 2, 3], 8, 9, temperature=1.0, top_p=0.9, seed=40, n=3)
    assert [c.ids for c in got[1]] == reference(lm, [4, 5], 8, 9, temperature=1.0, top_p=0.9, seed=41, n=3)
    assert got == generate(lm, [[1, 2, 3], [4, 5]], 8, temperature=1.0, top_p=0.9, n=3, stop_ids=(9,), seed=40)


def test_stream_yields_generates_reply_id_by_id_with_its_logits(lm):
    steps = list(stream(lm, [1, 2, 3], 9, temperature=0.7, stop_ids=(9,), seed=3))
    assert [i for i, _ in steps] == generate(lm, [[1, 2, 3]], 9, temperature=0.7, stop_ids=(9,), seed=3)[0][0].ids
    assert all(logits.shape == (97,) for _, logits in steps)
    greedy = list(stream(lm, [1, 2, 3], 9))
    assert all(int(logits.argmax()) == i for i, logits in greedy)


def test_the_context_rule_comes_from_the_registry():
    dense, hybrid = model(DENSE), model(HYBRID)
    assert room(dense, 36, 10) == 4 and room(dense, 40, 10) == 0
    assert room(hybrid, 10_000, 10) == 10                         # no positional limit
    assert len(generate(dense, [list(range(1, 37))], 10)[0][0].ids) <= 4
    with pytest.raises(ValueError, match="prompt 1 has 40 ids: no room to answer within the context 40"):
        generate(dense, [[1], list(range(40))], 4)
    assert generate(dense, [list(range(40))], 4, require_room=False) == [[Completion([], "length")]]
    check_room(dense, [list(range(40))], [0])                      # asking for nothing needs no room


def test_batches_group_one_length_and_budget_in_order_of_first_appearance():
    assert batches(PROMPTS, [8] * 7, batch_size=2) == [([0, 4], 8), ([1, 3], 8), ([2, 5], 8), ([6], 8)]
    assert batches(PROMPTS[:3], [8, 8, 4]) == [([0], 8), ([1], 8), ([2], 4)]


def test_the_test_time_step_sampler_runs_on_a_hybrid_policy():
    "Chapter 18's search steps read the context through the registry: a hybrid policy (no max_seq_len) samples them."
    policy = ChatModel(model(dataclasses.replace(HYBRID, vocab_size=TOK.vocab_size)), TOK)
    prompts = [policy.ask(solution_prompt(p.prompt)) for p in problems(3, seed=1)]
    steps = tt.sample_steps(policy, prompts, 6, 0.0, seed=0)
    stops = {*policy.line_ends, policy.end}
    for prompt, step in zip(prompts, steps):
        full = common.generate(policy.model, torch.tensor([prompt]), 6)[0, len(prompt):].tolist()
        assert step == full[:next((i + 1 for i, x in enumerate(full) if x in stops), len(full))]


def test_a_chat_model_loads_the_config_its_checkpoint_records(tmp_path):
    ckpt = chat_checkpoint(tmp_path, max_seq_len=64)
    chat = ChatModel.load(ckpt)
    assert chat.context == 64 and chat.tokenizer.vocab_size == chat.model.config.vocab_size == TOK.vocab_size
    assert chat.ask("Allegra")[-1] == chat.ask([{"role": "user", "content": "Allegra"}])[-1]
    other = dataclasses.replace(chat.model.config, max_seq_len=128)
    with pytest.raises(CheckpointError, match="holds another model"):
        ChatModel.load(ckpt, config=other)
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        ChatModel.load(tmp_path / "nowhere")


# --- a checkpoint to serve, checked before anything is built (issue 43, cause 2) --------------------------------

def reseal(folder):
    "Record the folder's files in its manifest anew: a damage the hashes cannot show."
    import json
    from openpretrain.core import sha256_file
    (folder / "manifest.json").write_text(json.dumps({p.relative_to(folder).as_posix(): sha256_file(p)
                                                      for p in sorted(folder.rglob("*"))
                                                      if p.is_file() and p.name != "manifest.json"}))


def recorded_as(ckpt, edit):
    "The checkpoint with its state.json's recorded model changed by `edit`, resealed."
    import json
    state = json.loads((ckpt / "state.json").read_text())
    edit(state["fingerprint"])
    (ckpt / "state.json").write_text(json.dumps(state))
    reseal(ckpt)
    return ckpt


@pytest.mark.parametrize("edit, problem", [
    (lambda f: f["model"].update(n_layers=80, d_model=8192, mlp_hidden=28672), "weights are not this model's"),
    (lambda f: f["model"].update(d_model=8192), "the model's is"),
    (lambda f: f["model"].update(n_layerz=2), "unknown key 'n_layerz'"),
    (lambda f: f.update(model=[1, 2]), "records no model config"),
    (lambda f: f["model"].update(d_model=-3), "d_model"),
])
def test_a_served_checkpoint_recording_another_model_is_refused_before_anything_is_built(tmp_path, monkeypatch, edit, problem):
    ckpt = recorded_as(chat_checkpoint(tmp_path), edit)
    import openpretrain.training.checkpoint as checkpoint
    built = []
    real = checkpoint.build_model
    monkeypatch.setattr(checkpoint, "build_model", lambda config, device="cpu", **kw: built.append(device) or real(config, device, **kw))
    with pytest.raises(CheckpointError, match=problem):
        ChatModel.load(ckpt)
    assert "cpu" not in built, "a model was allocated before its checkpoint was checked"


def test_a_garbage_tokenizer_is_one_config_error(tmp_path):
    from openpretrain.core import ConfigError
    ckpt = chat_checkpoint(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a tokenizer.json"):
        ChatModel.load(ckpt)
