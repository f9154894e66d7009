"""The experiment's model-facing parts of chapter 18 on a tiny random chat model: the verifier's batched, right-padded
scores against each conversation scored alone, the step sampler against greedy `generate`, what a verifier is trained
on, and the revision pairs. The study's pure logic is tested in test_test_time.py."""
import numpy as np
import pytest
import torch

from chat_models import TOK, chat_checkpoint
from openpretrain.core import load_preset
from openpretrain.evaluation.strategies import solution_prompt
from openpretrain.evaluation.testbed import answer_line, problems, solution_lines
from openpretrain.evaluation import test_time as tt
from openpretrain.models.common import generate
from openpretrain.models.dense import DenseConfig
from openpretrain.chat import chat_ids, render
from openpretrain.engine import ChatModel
from openpretrain.training.checkpoint import verify_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> ChatModel:
    root = tmp_path_factory.mktemp("chat")
    ckpt = chat_checkpoint(root, max_seq_len=256)
    config = DenseConfig(**verify_checkpoint(ckpt)["fingerprint"]["model"])
    return ChatModel.load(ckpt, root / "tokenizer.json", config)


PROBLEMS = problems(6, seed=3)


def test_verify_equals_each_conversation_alone(model):
    texts = [p.solution for p in PROBLEMS] + ["Answer: 7", PROBLEMS[0].steps[0]]
    questions = [p.prompt for p in PROBLEMS] + [PROBLEMS[1].prompt, PROBLEMS[2].prompt]
    lines = [solution_lines(t) for t in texts]
    batched = tt.verify(model, questions, lines, process=True, chunk=3)
    assistant, (plus,), (minus,) = chat_ids(TOK)["<|assistant|>"], TOK.encode(tt.PLUS), TOK.encode(tt.MINUS)
    for q, ls, got in zip(questions, lines, batched):
        ids = render(TOK, tt.verifier_turns(q, ls, [True] * len(ls)))[0]
        with torch.no_grad():
            logits = model.model(torch.tensor([ids]))[0]
        slots = [t for t, x in enumerate(ids) if x == assistant]
        want = torch.softmax(logits[slots][:, [plus, minus]], -1)[:, 0]
        assert len(got) == len(ls)
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-4, atol=1e-5)


def test_orm_scores_one_turn_and_empty_solutions_none(model):
    scores = tt.verify(model, [PROBLEMS[0].prompt] * 2, [solution_lines(PROBLEMS[0].solution), []], process=False)
    assert len(scores[0]) == 1 and scores[1] == []


def test_sample_steps_is_greedy_generate_cut_at_the_first_stop(model):
    prompts = [model.ask(solution_prompt(p.prompt)) for p in PROBLEMS[:4]]
    got = tt.sample_steps(model, prompts, max_tokens=12, temperature=0.0, seed=0)
    stops = {*model.line_ends, model.end}
    for prompt, step in zip(prompts, got):
        full = generate(model.model, torch.tensor([prompt]), 12)[0, len(prompt):].tolist()
        cut = next((i + 1 for i, x in enumerate(full) if x in stops), len(full))
        assert step == full[:cut]


def test_sample_steps_draws_depend_on_the_seed_only(model):
    prompts = [model.ask(solution_prompt(PROBLEMS[0].prompt))] * 3
    a = tt.sample_steps(model, prompts, 10, 1.0, seed=5)
    assert a == tt.sample_steps(model, prompts, 10, 1.0, seed=5)
    assert len({tuple(s) for s in a}) > 1 or a != tt.sample_steps(model, prompts, 10, 1.0, seed=6)


def test_verifier_targets_are_the_labels_only():
    p = PROBLEMS[0]
    conv = tt.verifier_conversation(p, p.solution, process=True)
    ids, target = render(TOK, conv["messages"])
    labels = [TOK.tok.decode([i]) for i, t in zip(ids, target) if t and i != chat_ids(TOK)["<|end|>"]]
    assert labels == [tt.PLUS] * (len(p.steps) + 1)


def test_revision_pairs_show_at_most_context_attempts():
    p = PROBLEMS[1]
    wrong = [p.solution.replace(answer_line(p.answer), answer_line(p.answer + k)) for k in range(1, 7)]
    for s in range(10):
        for c in tt.revision_conversations(p, [p.solution, *wrong], 2, np.random.default_rng(s)):
            prompt = c["messages"][0]["content"]
            assert prompt.count("Attempt ") <= 2 and c["messages"][1]["content"] == p.solution


def test_task_preset_carries_the_run_and_the_shape():
    base = load_preset("tiny")
    q = tt.task_preset(base, tt.TaskRun(lr=1e-3, batch_size=4, epochs=3), 512, {"d_model": 96}, seed=7)
    assert {k: q.raw["sft"][k] for k in ("lr", "batch_size", "epochs", "seq_len", "pack")} == {"lr": 1e-3, "batch_size": 4, "epochs": 3, "seq_len": 512, "pack": True}
    assert (q.raw["model"]["d_model"], q.raw["seed"]) == (96, 7)
    assert base.raw["model"]["d_model"] != 96    # the base preset is untouched


def test_monte_carlo_labels_of_an_answer_line_are_its_outcome(model):
    p = PROBLEMS[2]
    off = p.solution.replace(answer_line(p.answer), answer_line(p.answer + 1))
    right, wrong = (tt.mc_labels(model, p, t, rollouts=2, max_new_tokens=8, temperature=1.0, seed=0) for t in (p.solution, off))
    assert len(right) == len(p.steps) + 1 and right[-1] == 1.0 and wrong[-1] == 0.0   # the first answer line decides
    assert all(0.0 <= v <= 1.0 for v in right + wrong)
