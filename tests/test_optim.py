"AdEMAMix, schedules, clipping and parameter groups of openpretrain.training.optim against independent expectations."
import io
import math
import re

import pytest
import torch
from torch import nn

from openpretrain.core import ConfigError, load_preset
from openpretrain.models.registry import build_model, model_config
from openpretrain.training.optim import (AdEMAMix, OptimConfig, ScheduleConfig, StageConfig, alpha_at, beta3_at,
                                         Schedule, build_optimizer, clip_grad, param_groups)


# --- apple/ml-ademamix, pytorch/ademamix.py (the code Apertus ported verbatim), transcribed line by line ----------

def linear_warmup_scheduler(step, alpha_end, alpha_start=0, warmup=1):
    if step < warmup:
        a = step / float(warmup)
        return (1.0-a) * alpha_start + a * alpha_end
    return alpha_end


def linear_hl_warmup_scheduler(step, beta_end, beta_start=0, warmup=1):

    def f(beta, eps=1e-8):
        return math.log(0.5)/math.log(beta+eps)-1

    def f_inv(t):
        return math.pow(0.5, 1/(t+1))

    if step < warmup:
        a = step / float(warmup)
        return f_inv((1.0-a) * f(beta_start) + a * f(beta_end))
    return beta_end


def reference_step(p, grad, state, lr, betas, alpha_final, beta3_warmup, alpha_warmup, eps, lmbda):
    "The body of the reference `AdEMAMix.step` for one parameter tensor `p` (its `state` a dict)."
    beta1, beta2, beta3_final = betas
    if len(state) == 0:
        state['step'] = 0
        if beta1 != 0.0:
            state['exp_avg_fast'] = torch.zeros_like(p, memory_format=torch.preserve_format)
        else:
            state['exp_avg_fast'] = None
        state['exp_avg_slow'] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state['exp_avg_sq'] = torch.zeros_like(p, memory_format=torch.preserve_format)
    exp_avg_fast, exp_avg_slow, exp_avg_sq = state['exp_avg_fast'], state['exp_avg_slow'], state['exp_avg_sq']
    state['step'] += 1
    bias_correction1 = 1 - beta1 ** state['step']
    bias_correction2 = 1 - beta2 ** state['step']
    if alpha_warmup is not None:
        alpha = linear_warmup_scheduler(state["step"], alpha_end=alpha_final, alpha_start=0, warmup=alpha_warmup)
    else:
        alpha = alpha_final
    if beta3_warmup is not None:
        beta3 = linear_hl_warmup_scheduler(state["step"], beta_end=beta3_final, beta_start=beta1, warmup=beta3_warmup)
    else:
        beta3 = beta3_final
    if beta1 != 0.0:
        exp_avg_fast.mul_(beta1).add_(grad, alpha=1 - beta1)
    else:
        exp_avg_fast = grad
    exp_avg_slow.mul_(beta3).add_(grad, alpha=1 - beta3)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    update = (exp_avg_fast.div(bias_correction1) + alpha * exp_avg_slow) / denom
    update.add_(p, alpha=lmbda)
    p.add_(-lr * update)

# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("beta1", [0.9, 0.0])
def test_ademamix_equals_the_reference_code_bit_for_bit_over_300_steps(dtype, beta1):
    gen = torch.Generator().manual_seed(int(beta1 * 10))
    shapes = [(7, 5), (13,), (3, 4, 2)]
    init = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) * (1 + k % 3) for s in shapes] for k in range(300)]
    params, reference, states = [nn.Parameter(x.clone()) for x in init], [x.clone() for x in init], [{}, {}, {}]
    kw = dict(lr=3e-3, betas=(beta1, 0.99, 0.999), eps=1e-8)
    opt = AdEMAMix(params, alpha=6.0, t_alpha=120, t_beta3=150, weight_decay=0.1, **kw)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        for p, g, st in zip(reference, gs, states):
            reference_step(p, g.clone(), st, alpha_final=6.0, beta3_warmup=150, alpha_warmup=120, lmbda=0.1, **kw)
    for p, r in zip(params, reference):
        assert torch.equal(p.detach(), r)


def test_beta3_and_alpha_warmups_equal_the_reference_schedulers_for_every_step():
    for step in range(0, 1200, 7):
        assert beta3_at(step, 0.9, 0.9999, 1000) == linear_hl_warmup_scheduler(step, 0.9999, 0.9, 1000)
        assert beta3_at(step, 0.0, 0.999, 1000) == linear_hl_warmup_scheduler(step, 0.999, 0.0, 1000)  # β1 = 0
        assert alpha_at(step, 8.0, 1000) == linear_warmup_scheduler(step, 8.0, 0, 1000)
    without_eps = 0.5 ** (1 / ((math.log(0.5) / math.log(0.9) - 1 + math.log(0.5) / math.log(0.9999) - 1) / 2 + 1))
    assert beta3_at(50_000, 0.9, 0.9999, 100_000) != without_eps       # the ε inside the log is not a no-op


def test_ademamix_with_alpha_zero_is_torch_adamw():
    gen = torch.Generator().manual_seed(3)
    a = nn.Parameter(torch.randn(50, 3, generator=gen, dtype=torch.float64))
    b = nn.Parameter(a.detach().clone())
    opt_a = AdEMAMix([a], lr=1e-2, betas=(0.9, 0.95, 0.5), alpha=0.0, weight_decay=0.1, eps=1e-8)
    opt_b = torch.optim.AdamW([b], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    for _ in range(300):
        g = torch.randn(50, 3, generator=gen, dtype=torch.float64)
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_ademamix_matches_bitsandbytes_32bit_on_cpu():
    bnb = pytest.importorskip("bitsandbytes")
    gen = torch.Generator().manual_seed(4)
    a = nn.Parameter(torch.randn(400, generator=gen))
    b = nn.Parameter(a.detach().clone())
    kw = dict(lr=1e-2, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=50, t_beta3=50, weight_decay=0.1, eps=1e-8)
    opt_a, opt_b = AdEMAMix([a], **kw), bnb.optim.AdEMAMix([b], optim_bits=32, **kw)
    for _ in range(300):
        g = torch.randn(400, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # float32 rounding, 300 steps


def test_alpha_warmup_is_linear_zero_half_full():
    assert (alpha_at(0, 8.0, 1000), alpha_at(500, 8.0, 1000), alpha_at(1000, 8.0, 1000)) == (0.0, 4.0, 8.0)
    assert alpha_at(5000, 8.0, 1000) == 8.0 and alpha_at(3, 8.0, None) == 8.0


def test_beta3_warmup_runs_from_beta1_to_beta3_through_the_mean_half_life():
    T = 100_000
    assert beta3_at(0, 0.9, 0.9999, T) == pytest.approx(0.9, abs=1e-7)     # f⁻¹(f(β1)) up to the reference's ε
    assert beta3_at(T, 0.9, 0.9999, T) == 0.9999 and beta3_at(7 * T, 0.9, 0.9999, T) == 0.9999
    # by hand: half-lives ln .5/ln .9 − 1 = 5.5788, ln .5/ln .9999 − 1 = 6930.1; their mean 3467.86;
    # 0.5^(1/3468.86) = exp(−0.693147/3468.86) = exp(−1.99820e-4) = 0.99980020
    assert beta3_at(T // 2, 0.9, 0.9999, T) == pytest.approx(0.99980020, abs=2e-8)
    assert beta3_at(7, 0.9, 0.9999, None) == 0.9999


def test_state_dict_round_trip_continues_identically():
    def run(model, opt, batches):
        for x in batches:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    twin = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    config = OptimConfig(lr=1e-2, betas=[0.9, 0.99, 0.999], t_alpha=6, t_beta3=6)
    batches = [torch.randn(4, 6) for _ in range(12)]
    opt = build_optimizer(model, config)
    run(model, opt, batches[:5])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    run(model, opt, batches[5:])
    buf.seek(0)
    ckpt = torch.load(buf)
    twin.load_state_dict(ckpt["model"])
    twin_opt = build_optimizer(twin, config)
    twin_opt.load_state_dict(ckpt["optim"])
    run(twin, twin_opt, batches[5:])
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


NO_DECAY = {  # expected by reading the model code: gains, scalars, SSM vectors, biases
    "tiny": {r"layers\.\d+\.(attention|feedforward)_layernorm\.weight", r"layers\.\d+\.self_attn\.[qk]_norm\.weight",
             r"layers\.\d+\.mlp\.act_fn\.alpha_[pn]", r"norm\.weight"},
    "tiny-hybrid": {r"layers\.\d+\.norm\.weight", r"layers\.\d+\.mixer\.(A_log|D|dt_bias)",
                    r"layers\.\d+\.mixer\.conv1d\.bias", r"layers\.\d+\.mixer\.norm\.weight", r"norm_f\.weight"},
}


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_param_groups_exclude_norms_scalars_and_ssm_vectors_from_decay(preset):
    model = build_model(model_config(load_preset(preset)), device="meta")
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    no_names = [n for n, _ in no_decay["params"]]
    yes_names = [n for n, _ in decay["params"]]
    patterns = NO_DECAY[preset]
    assert all(any(re.fullmatch(p, n) for p in patterns) for n in no_names)
    assert not any(re.fullmatch(p, n) for p in patterns for n in yes_names)
    assert {"embed_tokens.weight", "lm_head.weight"} <= set(yes_names) or \
        {"embeddings.weight", "lm_head.weight"} <= set(yes_names)
    assert len(no_names) + len(yes_names) == len(list(model.parameters()))
    if preset == "tiny-hybrid":
        assert any(n.endswith("experts.up_proj") for n in yes_names) and any(n.endswith("gate.weight") for n in yes_names)


def test_optimizer_state_dict_names_its_parameters():
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    groups = build_optimizer(model, OptimConfig()).state_dict()["param_groups"]
    assert groups[0]["param_names"] == ["0.weight"] and groups[1]["param_names"] == ["0.bias", "1.weight", "1.bias"]


def test_clip_grad_returns_pre_clip_norm_and_clips_to_max():
    ps = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))]
    ps[0].grad, ps[1].grad = torch.tensor([1.0, 2.0]), torch.tensor([2.0, 4.0])  # norm √25 = 5
    assert clip_grad(ps, 0.1).item() == pytest.approx(5.0)
    assert torch.cat([ps[0].grad, ps[1].grad]).norm().item() == pytest.approx(0.1, rel=1e-5)
    assert clip_grad(ps, None).item() == pytest.approx(0.1, rel=1e-5)  # None: measure only
    assert torch.cat([ps[0].grad, ps[1].grad]).norm().item() == pytest.approx(0.1, rel=1e-5)


def preset_schedule(name: str) -> Schedule:
    "A preset's schedule at its data's sequence length (the one place a sequence length is set)."
    from openpretrain.training.data import DataConfig
    p = load_preset(name)
    return Schedule(p.section("optim", OptimConfig), p.section("data", DataConfig).seq_len)


def wsd(shape, **kw):
    sched = ScheduleConfig(kind="wsd", unit="steps", warmup=100, total=1000, decay=200, decay_shape=shape,
                           warmup_start=0.1, end=0.1, **kw)
    return Schedule(OptimConfig(lr=1.0, batch_size=2, batch_increase_at=[], batch_increase_to=[], schedule=sched),
                    seq_len=8)


@pytest.mark.parametrize("shape", ["1-sqrt", "linear", "cosine"])
def test_wsd_boundaries_warmup_from_ten_percent_stable_peak_end_at_floor(shape):
    s = wsd(shape)
    assert s.lr_at(0) == pytest.approx(0.1) and s.lr_at(50) == pytest.approx(0.55)
    assert s.lr_at(100) == 1.0 and s.lr_at(800) == 1.0
    assert s.lr_at(1000) == pytest.approx(0.1) and s.lr_at(5000) == pytest.approx(0.1)
    mid = {"1-sqrt": 0.1 + 0.9 * (1 - math.sqrt(0.5)), "linear": 0.55, "cosine": 0.55}[shape]
    assert s.lr_at(900) == pytest.approx(mid)
    assert s.lr_at(850) == pytest.approx({"1-sqrt": 0.1 + 0.9 * 0.5, "linear": 0.1 + 0.9 * 0.75,
                                          "cosine": 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))}[shape])


@pytest.mark.parametrize("shape", ["1-sqrt", "linear", "cosine"])
def test_wsd_rises_during_warmup_and_never_rises_after(shape):
    lrs = [wsd(shape).lr_at(t) for t in range(1200)]
    assert all(a < b for a, b in zip(lrs[:100], lrs[1:101]))
    assert all(a >= b for a, b in zip(lrs[100:], lrs[101:]))


def test_one_minus_sqrt_decays_faster_than_linear_early():
    assert wsd("1-sqrt").lr_at(820) < wsd("linear").lr_at(820)


def test_soofi_schedule_hits_table_2_values():
    s = preset_schedule("soofi-30b-a3b")
    assert s.lr_at(0) == 0.0 and s.lr_at(254) == pytest.approx(1e-3)
    assert s.lr_at(794_728) == pytest.approx(1e-3)          # end of the plateau = decay start
    assert s.lr_at(993_410) == pytest.approx(1e-5)          # configured total after the main annealing
    assert s.lr_at(1_020_000) == pytest.approx(1e-5) and s.lr_at(1_056_000) == pytest.approx(1e-5)
    assert s.lr_at(1_067_920) == 0.0 and s.total_steps == 1_067_920
    assert s.tokens_at(794_728) == 19_999_984_975_872        # the report's token count for the stable stage
    assert s.tokens_at(1_056_000) - s.tokens_at(993_410) == 1_575_128_924_160
    minus_sqrt = 1e-5 + (1e-3 - 1e-5) * (1 - math.sqrt(0.25))
    assert s.lr_at(794_728 + 198_682 / 4) == pytest.approx(minus_sqrt)


@pytest.mark.parametrize("preset,size,at,tokens_before,tokens_after", [
    ("apertus-8b", 1024, 7e12, 4_194_304, 8_388_608), ("apertus-70b", 2048, 4.4e12, 8_388_608, 16_777_216)])
def test_apertus_batch_doubles_at_published_tokens_with_lr_unchanged(preset, size, at, tokens_before, tokens_after):
    s = preset_schedule(preset)
    first_big = next(st for st, _, b in s.phases if b == 2 * size)
    assert s.tokens_at(first_big - 1) < at <= s.tokens_at(first_big)
    assert s.batch_size_at(first_big - 1) * 4096 == tokens_before and s.batch_size_at(first_big) * 4096 == tokens_after
    assert s.tokens_at(first_big + 1) - s.tokens_at(first_big) == tokens_after
    assert s.lr_at(first_big - 1) == s.lr_at(first_big + 1)
    assert s.lr_at(tokens=15e12) == pytest.approx(0.1 * s.peak) and s.lr_at(tokens=13.5e12) == s.peak


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid", "gpu-1", "apertus-8b", "apertus-70b", "soofi-30b-a3b"])
def test_every_preset_optim_section_builds_a_schedule_that_ends(preset):
    s = preset_schedule(preset)
    assert s.total_steps > 0 and s.lr_at(s.total_steps) <= s.lr_at(s.total_steps // 2)


def test_bad_configs_fail_with_a_named_problem():
    with pytest.raises(ConfigError, match="exceed total"):
        Schedule(OptimConfig(schedule=ScheduleConfig(warmup=10, decay=10, total=15)), seq_len=4096)
    with pytest.raises(ConfigError, match="shape"):
        Schedule(OptimConfig(schedule=ScheduleConfig(kind="stages", stages=[StageConfig(length=3, shape="sqrt")])), 4096)
    with pytest.raises(ConfigError, match="unknown optimiser"):
        build_optimizer(nn.Linear(2, 2), OptimConfig(name="sgd"))
    with pytest.raises(ValueError, match="three betas"):
        AdEMAMix(nn.Linear(2, 2).parameters(), betas=(0.9, 0.999))


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_tiny_schedules_consume_the_tiny_curriculum_and_decay_over_its_last_stage(preset):
    s = preset_schedule(preset)
    assert s.tokens_at(s.total_steps) == 524_288                 # the tiny curriculum: 2,048 rows of 256 tokens
    decay_start = s.total_steps - 32
    assert s.tokens_at(decay_start) == 393_216                   # its stage 2 (cooldown) starts here
    assert s.lr_at(decay_start) == s.peak > s.lr_at(decay_start + 1)
