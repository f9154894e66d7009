"""Preference losses (chapter 17): ours against literal transcriptions of both public QRPO losses (every transform),
the Apertus DPO loss and pair selection, TRL's DPOTrainer with loss_type="sigmoid_norm" on our transformers export,
the exact log Z at every β, the Apertus β clamp, and the objective moving a policy through chapter 11's `train`."""
import random
from types import SimpleNamespace

import mpmath
import pytest
import torch

import preference_reference as ref
from tiny_runs import small_preset
from openpretrain.core import to_dict
from openpretrain.models.registry import build_model
from openpretrain.posttrain.preference import (DPOConfig, PairConfig, PreferenceBatch, PreferenceLoader,
                                               PreferenceObjective, QRPOConfig, align, alignment_preset, beta_log_z,
                                               completion_beta, dpo_losses, identity_beta_log_z, preference_rows,
                                               qrpo_losses, quantile_reward, select_pairs)
from openpretrain.tokenization import load_tokenizer
from openpretrain.training.checkpoint import export_hf, load_model, save_checkpoint, verify_checkpoint
from openpretrain.training.plan import plan
from openpretrain.training.trainer import read_metrics

CPU = SimpleNamespace(device=torch.device("cpu"))


def random_pairs(seed: int, P: int = 256, n: int = 10):
    "Per-completion log-probs, lengths and rewards of P pairs, float64; integer rewards so that ties occur."
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(P, 2, generator=g, dtype=torch.float64) * 60
    ref_logps = logps + torch.randn(P, 2, generator=g, dtype=torch.float64) * 3
    lengths = torch.randint(1, 300, (P, 2), generator=g)
    ref_rewards = torch.randint(0, 8, (P, n), generator=g).double()
    rewards = torch.randint(-1, 9, (P, 2), generator=g).double()
    return logps, ref_logps, lengths, rewards, ref_rewards


def outputs(logps, lengths) -> dict:
    return {"chosen_logps": logps[:, 0], "rejected_logps": logps[:, 1],
            "chosen_lens": lengths[:, 0].float(), "rejected_lens": lengths[:, 1].float()}


def test_quantile_reward_counts_ties_and_equals_the_public_codes():
    logps, ref_logps, lengths, rewards, ref_rewards = random_pairs(0)
    logs = {}
    ref.claire_qrpo_loss(SimpleNamespace(accelerator=CPU, beta=0.1, qrpo_transform_type="identity", qrpo_loss_type="mse",
                                         qrpo_sample_selector="both"),
                         outputs(logps, lengths), ref_logps[:, 0], ref_logps[:, 1], rewards[:, 0], rewards[:, 1], ref_rewards, logs)
    q = quantile_reward(rewards, ref_rewards)
    assert torch.equal(q, torch.stack([logs["percentile_rewards/chosen"], logs["percentile_rewards/rejected"]], 1))
    assert torch.equal(quantile_reward(torch.tensor([[3.0]]), torch.tensor([[1.0, 3.0, 3.0, 4.0]])), torch.tensor([[0.75]]))


@pytest.mark.parametrize("transform", ["identity", "log", "normal-icdf", "scaled-normal-icdf"])
@pytest.mark.parametrize("beta", [3e-3, 0.1, 2.0])
def test_qrpo_equals_the_claire_labo_loss_for_every_transform(transform, beta):
    logps, ref_logps, lengths, rewards, ref_rewards = random_pairs(1)
    std = 1.7
    theirs, _, _ = ref.claire_qrpo_loss(
        SimpleNamespace(accelerator=CPU, beta=beta, qrpo_transform_type=transform, qrpo_loss_type="mse",
                        qrpo_sample_selector="both", mean_std_ref_rewards=std),
        outputs(logps, lengths), ref_logps[:, 0], ref_logps[:, 1], rewards[:, 0], rewards[:, 1], ref_rewards, {})
    c = QRPOConfig(beta=beta, transform=transform, log_z="claire", length_normalise=False, beta_max=None, reward_std=std)
    ours = qrpo_losses(c, logps - ref_logps, lengths, rewards, ref_rewards)
    # the public code works in float32 from its float32 quantiles (log Z, Φ⁻¹: log β + 1/β = 328 at β = 3e-3 holds
    # ~3e-5 of rounding, ×β); ours in the inputs' float64
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6), (ours - theirs).abs().max()


@pytest.mark.parametrize("normalise", [True, False])
@pytest.mark.parametrize("beta", [5.0, 0.05])
def test_qrpo_equals_the_apertus_trainer_with_its_clamp(normalise, beta):
    logps, ref_logps, lengths, rewards, ref_rewards = random_pairs(2)
    me = SimpleNamespace(accelerator=CPU, beta=beta, normalize_beta_by_length=normalise, normalize_loss_by_length=False)
    theirs, _, _ = ref.apertus_qrpo_loss(me, outputs(logps, lengths), ref_logps[:, 0], ref_logps[:, 1], rewards[:, 0],
                                         rewards[:, 1], None, None, ref_rewards, {})
    c = QRPOConfig(beta=beta, transform="identity", log_z="apertus", length_normalise=normalise, beta_max=0.1)
    ours = qrpo_losses(c, logps - ref_logps, lengths, rewards, ref_rewards)
    # their β is a float32 tensor (torch.ones * beta); ours follows the inputs' float64
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-8), (ours - theirs).abs().max()


@pytest.mark.parametrize("normalise", [True, False])
def test_dpo_equals_the_apertus_trainer(normalise):
    logps, ref_logps, lengths, rewards, ref_rewards = random_pairs(3)
    me = SimpleNamespace(accelerator=CPU, beta=5.0, normalize_beta_by_length=normalise, normalize_loss_by_length=False)
    theirs, _, _ = ref.apertus_dpo_loss(me, outputs(logps, lengths), ref_logps[:, 0], ref_logps[:, 1], None, None,
                                        None, None, None, {})
    ours = dpo_losses(DPOConfig(beta=5.0, length_normalise=normalise), logps - ref_logps, lengths)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7), (ours - theirs).abs().max()


def test_the_exact_identity_log_z_is_finite_and_right_for_every_beta():
    mpmath.mp.dps = 60
    betas = torch.logspace(-8, 12, 81, dtype=torch.float64)
    truth = torch.tensor([float(b * mpmath.log(b * mpmath.expm1(1 / mpmath.mpf(b)))) for b in betas.tolist()],
                         dtype=torch.float64)
    ours = identity_beta_log_z(betas)
    assert torch.isfinite(ours).all() and ((ours - truth).abs() / truth.abs()).max() < 1e-13
    b = torch.tensor([1e-4, 0.1, 0.2, 0.3, 5.0], dtype=torch.float64)
    assert torch.allclose(beta_log_z(b, "identity", "claire"), b * b.log() + 1)        # log β + 1/β, times β
    apertus = beta_log_z(b, "identity", "apertus")
    assert torch.allclose(apertus[:3], b[:3] * b[:3].log() + 1) and torch.allclose(apertus[3:], ours.new_tensor(
        [float(x * mpmath.log(x * mpmath.expm1(1 / mpmath.mpf(x)))) for x in (0.3, 5.0)]))


def test_the_apertus_clamp_undoes_length_normalisation_below_50_tokens_at_beta_5():
    lengths = torch.arange(1, 301)[None]
    used = completion_beta(5.0, lengths, True, QRPOConfig().beta_max, torch.float64)[0]
    assert torch.equal(used, torch.where(lengths[0] < 50, 0.1, 5.0 / lengths[0].double()))
    assert QRPOConfig().beta_max == 0.1 and completion_beta(5.0, lengths, False, 0.1)[0].eq(0.1).all()


def test_pairs_equal_the_apertus_script_and_skip_without_a_contrast():
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    n, m, P = 10, 14, 300
    ref_rewards = torch.randint(0, 6, (P, n), generator=g).double()          # ties: some prompts lack a bottom tier
    offline = torch.randint(-1, 8, (P, m - n), generator=g).double()
    rewards = torch.cat([ref_rewards, offline], 1)
    q = quantile_reward(rewards, ref_rewards)
    lax, strict = select_pairs(q, PairConfig(n_refs=n, fallback=True)), select_pairs(q, PairConfig(n_refs=n))
    low, kept = max(0.2, 1 / n), dict(zip(strict.prompts.tolist(), zip(strict.chosen.tolist(), strict.rejected.tolist())))
    count = lambda i, j: round(q[i, j].item() * n)                            # our float32 q as a count of references
    for i in range(P):
        row = ref.compute_quantile_rewards({"ref_rewards": ref_rewards[i].tolist(), "conversation_branches": [
            {"reward": r} for r in rewards[i].tolist()]})                       # the script's q, in Python floats
        assert [count(i, j) for j in range(m)] == [round(b["quantile_reward"] * n) for b in row["conversation_branches"]]
        random.seed(rng.random())
        chosen, rejected = ref.select_chosen_rejected_pairs({**row, "num_ref_rewards": n}, 1)["chosen_rejected_pairs"][0]
        # ties in q are broken at random by the script, by position by us: compare the quantiles picked
        theirs = (round(chosen["quantile_reward"] * n), round(rejected["quantile_reward"] * n))
        assert (count(i, lax.chosen[i]), count(i, lax.rejected[i])) == theirs
        contrast = chosen["quantile_reward"] >= 1 and rejected["quantile_reward"] <= low
        assert (i in kept) == contrast
        if contrast:
            assert (count(i, kept[i][0]), count(i, kept[i][1])) == theirs
    assert strict.skipped == P - len(kept) > 0 and lax.skipped == 0


def pair_texts(i: int) -> dict:
    return {"prompt": f"Übersetze ins Rumantsch: Alle Menschen sind frei {i}.",
            "chosen": " Tut ils umans naschan libers" + " e eguals" * (i % 3),
            "rejected": " Alle Menschen" + " sind" * (1 + i % 4)}


def test_our_dpo_equals_trl_dpo_trainer_sigmoid_norm(tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import DPOConfig as TRLConfig
    from trl import DPOTrainer
    tok = load_tokenizer("bpe-bal-2k")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok.tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    config = plan(small_preset(micro_batch=1, lr=3e-3, batch_size=4, warmup=0.25)).model
    models, exports = {}, {}
    for name, seed in (("policy", 1), ("reference", 2)):
        torch.manual_seed(seed)
        models[name] = build_model(config).eval()
        loader = PreferenceLoader(PreferenceBatch(*preference_rows([[1]], [[[2], [3]]], 0), torch.zeros(1, 2), torch.zeros(1, 2)), 1)
        ckpt = save_checkpoint(tmp_path / name, models[name], torch.optim.SGD(models[name].parameters()), loader, 0,
                               "full", {"model": to_dict(config)})
        exports[name] = AutoModelForCausalLM.from_pretrained(export_hf(ckpt, tmp_path / f"{name}-hf"))
    trainer = DPOTrainer(model=exports["policy"], ref_model=exports["reference"], processing_class=hf_tok,
                         train_dataset=Dataset.from_list([pair_texts(i) for i in range(6)]),
                         args=TRLConfig(output_dir=str(tmp_path / "trl"), loss_type=["sigmoid_norm"], beta=5.0,
                                        report_to="none", use_cpu=True, bf16=False))
    rows = [trainer.train_dataset[i] for i in range(6)]
    with torch.no_grad():
        theirs = trainer.compute_loss(trainer.model, trainer.data_collator(rows)).item()
        ids, mask = preference_rows([r["prompt_ids"] for r in rows], [[r["chosen_ids"], r["rejected_ids"]] for r in rows],
                                    hf_tok.pad_token_id)
        batch = PreferenceBatch(ids, mask, torch.zeros(6, 2), torch.zeros(6, 1))
        objective = PreferenceObjective(models["reference"], DPOConfig(beta=5.0))
        ours = (objective.loss_sum(models["policy"], batch) / objective.count(batch)).item()
    assert rows[0]["chosen_ids"][-1] == hf_tok.eos_token_id                     # TRL appends EoS to every completion
    assert abs(ours - theirs) < 1e-5 and abs(theirs - 0.6931) > 1e-2, (ours, theirs)


def test_a_qrpo_run_through_align_raises_the_chosen_and_lowers_the_rejected(tmp_path):
    tok = load_tokenizer("bpe-bal-2k")
    texts = [pair_texts(i) for i in range(8)]
    prompts = [[tok.bos_id, *tok.encode(t["prompt"])] for t in texts]
    ids, mask = preference_rows(prompts, [[tok.encode(t["chosen"]), tok.encode(t["rejected"])] for t in texts], 0)
    data = PreferenceBatch(ids, mask, torch.tensor([[9.0, 0.0]]).expand(8, 2), torch.arange(10.0).expand(8, 10))
    assert torch.equal(quantile_reward(data.rewards, data.ref_rewards), torch.tensor([[1.0, 0.1]]).expand(8, 2))
    tok_path = tmp_path / "tokenizer.json"
    tok.tok.save(str(tok_path))
    p = small_preset(micro_batch=1, warmup=0.25)
    p.raw["alignment"] = {"lr": 3e-3, "batch_size": 4, "epochs": 1, "curve_points": 2}
    pl = plan(alignment_preset(p, tok_path, tok.vocab_size, 8))
    assert pl.steps == 2 and pl.accumulation(0) == 4                                # 4 prompts a step, one a micro-batch
    torch.manual_seed(0)
    start = build_model(pl.model)
    init = save_checkpoint(tmp_path / "start", start, torch.optim.SGD(start.parameters()), PreferenceLoader(data, 1), 0,
                           "full", {"model": to_dict(pl.model)})
    kept = align(p, init, tok_path, tmp_path / "run", data, QRPOConfig())
    assert [verify_checkpoint(c)["step"] for c in kept] == [1, 2]                   # the curve point, then the final one
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 2
    objective = PreferenceObjective(load_model(init, pl.model), QRPOConfig())
    with torch.no_grad():
        moved = objective.logratio(load_model(kept[-1], pl.model), data).mean(0)   # (2,): chosen, rejected
    assert moved[0] > 0 > moved[1], moved
    assert align(p, init, tok_path, tmp_path / "run", data, QRPOConfig()) == kept  # a finished run resumes to itself
