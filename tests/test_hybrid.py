"""Soofi S / Nemotron-H hybrid: Mamba-2 SSD, sigmoid-routed MoE, the model, its cache and transformers interop."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from openpretrain.core import ConfigError, load_preset
from openpretrain.models.common import cache_bytes_per_token, generate, param_counts
from openpretrain.models.dense import DenseConfig, DenseLM
from openpretrain.models.hybrid import (HybridConfig, HybridLM, aux_loss, build, config_from_hf, from_hf, mamba_state_bytes,
                                       to_hf)
from openpretrain.models.registry import build_model, model_config
from openpretrain.models.mamba2 import Mamba2Mixer, ssd_chunked, ssd_recurrent
from openpretrain.models.moe import MoE, SigmoidRouter, sequence_balance_loss, update_expert_bias

# every layer kind, small enough for a CPU test
SMALL = HybridConfig(vocab_size=97, d_model=32, pattern="M*E-ME*M", n_heads=4, n_kv_heads=2, head_dim=8,
                     mamba_heads=4, mamba_head_dim=8, mamba_groups=2, mamba_state=8, mamba_chunk=8,
                     n_experts=8, top_k=3, expert_hidden=16, shared_hidden=24, mlp_hidden=40)


def random_ssm(b, L, h, p, g, n, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    return dict(x=r(b, L, h, p), dt=F.softplus(r(b, L, h) - 1), A=-torch.exp(r(h)), B=r(b, L, g, n),
                C=r(b, L, g, n), D=r(h)), r(b, h, p, n)


# ---------------------------------------------------------------- Mamba-2 / SSD

@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 70), chunk=st.sampled_from([1, 3, 8, 16, 64]), groups=st.sampled_from([1, 2]),
       with_state=st.booleans(), seed=st.integers(0, 10_000))
def test_chunked_ssd_equals_recurrence(L, chunk, groups, with_state, seed):
    inputs, h0 = random_ssm(2, L, 4, 3, groups, 5, seed)
    y_ref, s_ref = ssd_recurrent(**inputs, state=h0 if with_state else None)
    y, s = ssd_chunked(**inputs, chunk_size=chunk, state=h0 if with_state else None)
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s, s_ref, rtol=1e-9, atol=1e-9)


def test_chunked_ssd_gradients_equal_recurrence_gradients():
    inputs, h0 = random_ssm(1, 29, 4, 3, 2, 5, seed=3)
    grads = []
    for fn in (lambda **kw: ssd_recurrent(**kw), lambda **kw: ssd_chunked(**kw, chunk_size=8)):
        leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
        y, s = fn(**leaves, state=h0)
        (y.sin().sum() + s.cos().sum()).backward()
        grads.append({k: v.grad for k, v in leaves.items()})
    for k in inputs:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-8, atol=1e-8)


def test_ssd_reset_forgets_the_previous_document():
    inputs, _ = random_ssm(1, 30, 4, 3, 2, 5, seed=5)
    reset = torch.zeros(1, 30, dtype=torch.bool)
    reset[0, 17] = True
    y, _ = ssd_chunked(**inputs, chunk_size=8, reset=reset)
    second = {k: (v[:, 17:] if v.dim() > 1 else v) for k, v in inputs.items()}
    y_alone, _ = ssd_recurrent(**second)
    torch.testing.assert_close(y[:, 17:], y_alone, rtol=1e-9, atol=1e-9)


def mixer(seed=0):
    torch.manual_seed(seed)
    m = Mamba2Mixer(d_model=16, n_heads=4, head_dim=4, n_groups=2, d_state=8, d_conv=4, chunk_size=4).eval()
    with torch.no_grad():
        m.dt_bias.uniform_(-3, 0)
        m.A_log.uniform_(0, 2)
    return m


def test_mamba_mixer_cached_steps_equal_full_pass():
    m, u = mixer(), torch.randn(2, 15, 16)
    with torch.no_grad():
        full = m(u)
        state = m.new_state(2)
        stepped = torch.cat([m(u[:, :6], state)] + [m(u[:, t:t + 1], state) for t in range(6, 15)], 1)
    torch.testing.assert_close(stepped, full, rtol=1e-5, atol=1e-5)


def test_mamba_mixer_packed_documents_do_not_see_each_other():
    m, a, b = mixer(), torch.randn(1, 10, 16), torch.randn(1, 7, 16)
    with torch.no_grad():
        packed = m(torch.cat([a, b], 1), segments=torch.tensor([[4] * 10 + [9] * 7]))
        torch.testing.assert_close(packed, torch.cat([m(a), m(b)], 1), rtol=1e-5, atol=1e-5)


def test_mamba_conv1d_path_equals_the_shifted_taps_in_values_and_gradients():
    m = mixer()
    xBC = torch.randn(2, 13, m.conv_dim, requires_grad=True)
    one_document = torch.zeros(2, 13, dtype=torch.long)   # the masked taps path, masking nothing
    taps, conv = m._conv(xBC, None, one_document), m._conv(xBC, None)
    torch.testing.assert_close(conv, taps)
    dy, params = torch.randn_like(taps), [xBC, m.conv1d.weight, m.conv1d.bias]
    for a, b in zip(torch.autograd.grad(conv, params, dy), torch.autograd.grad(taps, params, dy)):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- MoE

def test_router_bias_changes_the_choice_but_not_the_weights():
    torch.manual_seed(0)
    router = SigmoidRouter(d_model=6, n_experts=5, top_k=2, scaling=2.5)
    torch.nn.init.normal_(router.weight)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 10.0]))   # expert 4 always chosen
    x = torch.randn(7, 6)
    weights, idx, scores = router(x)
    for t in range(7):   # naive per-token expectation
        s = torch.sigmoid(x[t] @ router.weight.T)
        chosen = set((s + router.expert_bias).topk(2).indices.tolist())
        assert set(idx[t].tolist()) == chosen and 4 in chosen
        expected = {e: (s[e] / s[list(chosen)].sum() * 2.5).item() for e in chosen}
        got = dict(zip(idx[t].tolist(), weights[t].tolist()))
        assert got == pytest.approx(expected, rel=1e-5)


def test_moe_sorted_dispatch_equals_a_per_token_loop():
    torch.manual_seed(1)
    moe = MoE(d_model=8, n_experts=6, top_k=2, expert_hidden=5, shared_hidden=7)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 9, 8)
    out = moe(x)
    relu2 = lambda v: F.relu(v) ** 2
    for b in range(2):
        for t in range(9):
            s = torch.sigmoid(x[b, t] @ moe.gate.weight.T)
            top = s.topk(2).indices
            w = s[top] / s[top].sum() * moe.gate.scaling
            y = sum(w[i] * (relu2(x[b, t] @ moe.experts.up_proj[e].T) @ moe.experts.down_proj[e].T)
                    for i, e in enumerate(top.tolist()))
            y = y + moe.shared_experts.down_proj(relu2(moe.shared_experts.up_proj(x[b, t])))
            torch.testing.assert_close(out[b, t], y, rtol=1e-5, atol=1e-5)
    assert moe.gate.load.sum() == 2 * 9 * 2


def test_update_expert_bias_moves_towards_balance_and_resets_counts():
    model = MoE(d_model=4, n_experts=4, top_k=1, expert_hidden=3, shared_hidden=3)
    model.gate.load.copy_(torch.tensor([10.0, 0.0, 5.0, 5.0]))
    (load,) = update_expert_bias(model, rate=0.01)
    assert load.tolist() == [10.0, 0.0, 5.0, 5.0]
    assert model.gate.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])
    assert model.gate.load.sum() == 0


def test_sequence_balance_loss_is_one_when_balanced_and_larger_when_collapsed():
    E, L = 4, 8
    uniform = torch.full((1, L, E), 0.5)
    balanced = torch.tensor([[[0, 1], [2, 3]] * (L // 2)])
    assert sequence_balance_loss(uniform, balanced).item() == pytest.approx(1.0)
    peaked = torch.tensor([[[0.9, 0.9, 0.1, 0.1]] * L])
    collapsed = torch.tensor([[[0, 1]] * L])
    assert sequence_balance_loss(peaked, collapsed).item() == pytest.approx(2 * 0.45 * 2)


# ---------------------------------------------------------------- the model

def small_model(seed=0, **changes):
    torch.manual_seed(seed)
    return build(dataclasses.replace(SMALL, **changes)).eval()


def test_cached_decoding_equals_full_recomputation():
    model, ids = small_model(), torch.randint(0, 97, (2, 26))
    with torch.no_grad():
        full = model(ids)
        cache = model.init_cache(2, 26)
        stepped = torch.cat([model(ids[:, :11], cache=cache)] +
                            [model(ids[:, t:t + 1], cache=cache) for t in range(11, 26)], 1)
    torch.testing.assert_close(stepped, full, rtol=1e-4, atol=1e-5)


def test_generate_equals_greedy_decoding_without_cache():
    model, prompt = small_model(seed=2, init_std=0.3), torch.randint(0, 97, (2, 5))
    out = generate(model, prompt, max_new_tokens=7)
    seq = prompt
    with torch.no_grad():
        for _ in range(7):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_packed_documents_equal_separate_runs():
    model, ids = small_model(), torch.randint(0, 97, (1, 30))
    with torch.no_grad():
        packed = model(ids, doc_ids=torch.tensor([[3] * 12 + [8] * 18]))
        alone = torch.cat([model(ids[:, :12]), model(ids[:, 12:])], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)


def test_training_step_on_packed_documents_with_aux_loss_reaches_every_parameter():
    model = small_model(aux_loss_coef=1e-2).train()
    ids, doc_ids = torch.randint(0, 97, (2, 20)), torch.tensor([[0] * 7 + [1] * 13, [5] * 20])
    logits = model(ids, doc_ids=doc_ids)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1)) + aux_loss(model)
    loss.backward()
    assert aux_loss(model).item() > 0
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if "experts.up_proj" not in name and "experts.down_proj" not in name:
            assert p.grad.abs().sum() > 0, name


def test_init_follows_nemotron():
    model = build(dataclasses.replace(SMALL, d_model=256, mamba_heads=16, mamba_head_dim=16))
    mixer = model.layers[0].mixer
    assert torch.allclose(mixer.A_log, torch.log(torch.arange(1.0, 17.0)))
    assert torch.equal(mixer.D, torch.ones(16))
    dt = F.softplus(mixer.dt_bias)
    assert (dt >= 1e-3 - 1e-7).all() and (dt <= 0.1 + 1e-7).all()
    bound = 1 / 256 ** 0.5 / len(SMALL.pattern) ** 0.5   # kaiming-uniform(a=√5) / √n_layers
    assert mixer.out_proj.weight.abs().max() <= bound
    assert mixer.out_proj.weight.abs().max() > 0.9 * bound
    assert abs(model.layers[1].mixer.q_proj.weight.std().item() - 0.02) < 0.002
    assert not torch.isnan(torch.cat([p.flatten() for p in model.parameters()])).any()


@pytest.mark.parametrize("change,message", [
    (dict(pattern="ME*X"), "unknown layer kinds"),
    (dict(pattern=""), "pattern is empty"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=9), "top_k 9 exceeds model.n_experts 8"),
    (dict(d_model=0), "d_model"),
    (dict(mamba_state=-4), "mamba_state"),
    (dict(expert_hidden=0), "expert_hidden"),
    (dict(mamba_heads=3), "mamba_groups"),
])
def test_config_refuses_impossible_shapes_naming_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(SMALL, **change)


# ---------------------------------------------------------------- transformers interop

def test_logits_match_transformers_nemotron_h():
    model = small_model(seed=4, init_std=0.3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MoE):
                m.gate.expert_bias.normal_(std=0.05)
    hf = to_hf(model).eval()
    assert type(hf).__name__ == "NemotronHForCausalLM" and hf.config.hybrid_override_pattern == SMALL.pattern
    ids = torch.randint(0, 97, (2, 41))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ours.abs().mean() > 0.1   # not a trivially small output
    assert (ours - theirs).abs().max() <= 1e-4


def test_save_pretrained_loads_as_nemotron_h_and_round_trip_is_exact(tmp_path):
    from transformers import AutoModelForCausalLM
    model = small_model(seed=5, init_std=0.1)
    to_hf(model).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "NemotronHForCausalLM"
    back = from_hf(loaded)
    assert back.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("change", [dict(moe_latent_size=16), dict(attention_bias=True), dict(sliding_window=64)])
def test_from_hf_refuses_features_we_do_not_implement(change):
    from transformers import NemotronHConfig
    with pytest.raises(ConfigError, match=next(iter(change))):
        config_from_hf(NemotronHConfig(hybrid_override_pattern="ME", **change))


# ---------------------------------------------------------------- accounting and dispatch

def test_soofi_parameter_counts_match_the_report():
    counts = param_counts(build(model_config(load_preset("soofi-30b-a3b")), device="meta"))
    assert counts["total"] == pytest.approx(31.6e9, rel=0.01)
    assert counts["active"] - counts["embedding"] == pytest.approx(3.2e9, rel=0.01)
    assert counts["active"] == pytest.approx(3.6e9, rel=0.01)


def test_soofi_cache_bytes():
    soofi = model_config(load_preset("soofi-30b-a3b"))
    assert cache_bytes_per_token(soofi, torch.bfloat16) == 6 * 2 * 2 * 128 * 2   # ≈ 6 KB
    per_layer = (4096 + 2 * 8 * 128) * 3 * 2 + 64 * 64 * 128 * 4                # conv window bf16 + SSM fp32
    assert mamba_state_bytes(soofi) == 23 * per_layer


def test_hybrid_cache_holds_only_what_each_layer_needs():
    model = small_model()
    cache = model.init_cache(3, 50)
    assert len(cache.kv.k) == SMALL.kv_layers and cache.kv.k[0].shape == (3, 2, 50, 8)
    kinds = [type(s).__name__ for s in cache.states]
    assert kinds == ["MambaState", "KVCache", "NoneType", "NoneType", "MambaState", "NoneType", "KVCache", "MambaState"]


def test_build_model_dispatches_on_the_preset_architecture():
    assert isinstance(build_model(model_config(load_preset("tiny-hybrid"))), HybridLM)
    dense = model_config(load_preset("apertus-8b"))
    assert isinstance(dense, DenseConfig) and isinstance(build_model(dense, device="meta"), DenseLM)
    with pytest.raises(TypeError):
        build_model(object())


def test_registry_converts_both_families_through_transformers():
    from openpretrain.models import registry
    for config in (SMALL, DenseConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, mlp_hidden=24)):
        model = build_model(config)
        back = registry.from_hf(registry.to_hf(model))
        assert type(back) is type(model) and back.config == config
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        registry.from_hf(transformers_model("llama"))


def transformers_model(model_type: str):
    "A stand-in with only what `from_hf` reads first: `config.model_type`."
    return type("HF", (), {"config": type("C", (), {"model_type": model_type})()})()


def test_model_config_names_an_unknown_architecture(tmp_path):
    path = tmp_path / "odd.yaml"
    path.write_text("preset: odd\nmodel:\n  arch: transformer-xl\n")
    with pytest.raises(ConfigError, match="unknown architecture 'transformer-xl'"):
        model_config(load_preset(path))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ssd_on_cuda_matches_the_cpu_chunked_result():
    from openpretrain.models.mamba2 import ssd
    inputs, h0 = random_ssm(2, 300, 8, 16, 2, 32, seed=7, dtype=torch.float32)
    y_cpu, s_cpu = ssd_chunked(**inputs, chunk_size=64, state=h0)
    y, s = ssd(**{k: v.cuda() for k, v in inputs.items()}, chunk_size=64, state=h0.cuda())
    torch.testing.assert_close(y.cpu().float(), y_cpu, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(s.cpu().float(), s_cpu, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_compiled_blocks_train_at_two_lengths_with_the_eager_model_gradients():
    eager = small_model().train()
    fused = build(SMALL, compile=True).train()   # one compiled graph per (block kind, shape)
    fused.load_state_dict(eager.state_dict())
    for T in (32, 24):   # a second length recompiles: torch 2.13's dynamic-shape path failed here (1 < s27)
        ids = torch.randint(0, 97, (2, T))
        grads = [torch.autograd.grad(m(ids).square().mean(), m.embeddings.weight)[0] for m in (eager, fused)]
        torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)
