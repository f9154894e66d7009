"""The Apertus dense decoder and the shared model parts, against transformers and against their defining properties."""
import ast
import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openpretrain.core import ConfigError, load_preset
from openpretrain.models.common import (KVCache, RMSNorm, apply_rope, cache_bytes_per_token, document_positions,
                                        generate, param_counts, rope_inv_freq, sample_next)
from openpretrain.models.dense import (XIELU, DenseConfig, build, from_hf, hf_config, to_hf,
                                       train_flops_per_token, xielu, xielu_eager, xielu_reference)

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)


def small(**kw) -> DenseConfig:
    return DenseConfig(**{**dict(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=168,
                                 max_seq_len=64, init_std=0.05), **kw})


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build(small()).eval()


# --- parameter counts of the published shapes --------------------------------------------------------------------
@pytest.mark.parametrize("preset,named,layers,hidden,mlp,heads,kv_heads", [
    ("apertus-8b", 8e9, 32, 4096, 21504, 32, 8), ("apertus-70b", 70e9, 80, 8192, 43008, 64, 8)])
def test_published_presets_count_what_the_table_1_shapes_imply(preset, named, layers, hidden, mlp, heads, kv_heads):
    vocab, hd = 131_072, 128  # Apertus §2.1: the Tekken vocabulary; head width hidden / query heads
    assert hidden // heads == hd
    embeddings = 2 * vocab * hidden                                    # untied: input table + output head
    attention = hidden * hd * (heads + 2 * kv_heads) + heads * hd * hidden  # q, k, v, o; no biases
    mlp_matrices = 2 * hidden * mlp                                    # ungated: up + down
    norms = 2 * hidden + 2 * hd                                        # two pre-norms + QK-norms over head_dim
    xielu = 2                                                          # a_p, a_n per layer
    expected = embeddings + layers * (attention + mlp_matrices + norms + xielu) + hidden  # + final norm
    model = build(load_preset(preset).section("model", DenseConfig), device="meta")
    assert all(p.is_meta for p in model.parameters())
    counts = param_counts(model)
    assert counts["total"] == expected
    assert abs(expected / named - 1) < 0.01  # the shapes give the scale the report names the model by
    assert counts["active"] == counts["total"]  # dense: every parameter is used by every token
    assert counts["embedding"] == vocab * hidden  # one untied input table


def test_building_a_dense_model_imports_no_hybrid_code():
    code = ("import sys\nimport openpretrain.models.dense\n"
            "from openpretrain.core import load_preset\n"
            "from openpretrain.models.registry import build_model, model_config\n"
            "build_model(model_config(load_preset('tiny')), device='meta')\n"
            "print(sorted(m for m in sys.modules if m.startswith('openpretrain.models')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = set(ast.literal_eval(out.stdout.strip().splitlines()[-1]))
    assert "openpretrain.models.dense" in loaded
    assert not loaded & {"openpretrain.models.mamba2", "openpretrain.models.moe", "openpretrain.models.hybrid"}


def test_tiny_preset_builds_a_small_model_on_cpu():
    model = build(load_preset("tiny").section("model", DenseConfig))
    assert 1e6 < param_counts(model)["total"] < 2e7
    assert model(torch.randint(0, model.config.vocab_size, (1, 8))).shape == (1, 8, model.config.vocab_size)


def test_model_section_rejects_unknown_knob_and_wrong_arch():
    with pytest.raises(ValueError):
        DenseConfig(arch="hybrid")
    from openpretrain.core import from_dict
    with pytest.raises(ConfigError, match="n_layer"):
        from_dict(DenseConfig, {"n_layer": 2})


def test_active_param_count_hook_is_used_for_partly_active_modules():
    class Experts(torch.nn.Module):  # 8 experts, 2 used per token
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(8, 10, 10))

        def active_param_count(self):
            return 2 * 10 * 10
    net = torch.nn.Sequential(torch.nn.Embedding(5, 10), torch.nn.Linear(10, 10), Experts())
    assert param_counts(net) == {"total": 50 + 110 + 800, "active": 50 + 110 + 200, "embedding": 50}


def test_swiglu_variant_matches_xielu_parameters_without_qk_norm():
    xielu_model, swiglu_model = build(small(), "meta"), build(small(activation="swiglu", qk_norm=False), "meta")
    per_layer = 2 * 16 + 2  # q/k norm gains (head_dim 16) and xIELU's (a_p, a_n); the MLP matrices match exactly
    assert param_counts(xielu_model)["total"] - param_counts(swiglu_model)["total"] == 2 * per_layer
    assert not any("q_norm" in n for n, _ in swiglu_model.named_parameters())


def test_output_projections_get_depth_scaled_init():
    torch.manual_seed(0)
    m = build(DenseConfig(vocab_size=256, d_model=256, n_layers=8, n_heads=4, n_kv_heads=2, mlp_hidden=1024))
    std = m.config.init_std
    assert m.layers[0].self_attn.q_proj.weight.std().item() == pytest.approx(std, rel=0.02)
    assert m.layers[0].mlp.down_proj.weight.std().item() == pytest.approx(std / 4, rel=0.02)  # /√(2·8)
    assert m.embed_tokens.weight.std().item() == pytest.approx(std, rel=0.02)


def test_train_flops_count_six_per_matmul_parameter():
    c = small()
    m = build(c, "meta")
    matmul = param_counts(m)["total"] - param_counts(m)["embedding"] - sum(
        p.numel() for n, p in m.named_parameters() if "norm" in n or "act_fn" in n)
    assert train_flops_per_token(c, 1) == 6 * matmul + 6 * c.n_layers * c.n_heads * c.head_dim


# --- xIELU and RoPE against transformers ------------------------------------------------------------------------
def test_xielu_matches_transformers_values_and_gradients():
    from transformers.activations import XIELUActivation
    ref, ours = XIELUActivation(dtype=torch.float32), XIELU()
    with torch.no_grad():  # move away from the init so a_p, a_n mistakes show
        for m in (ref, ours):
            m.alpha_p.fill_(0.3), m.alpha_n.fill_(-0.7)
    x = torch.cat([torch.randn(4000) * 4, torch.tensor([0.0, -1e-6, -3e-6, 1e-7, -40.0])]).requires_grad_()
    torch.testing.assert_close(ours(x), ref(x))
    g_ours = torch.autograd.grad(ours(x).square().sum(), [x, ours.alpha_p, ours.alpha_n])
    g_ref = torch.autograd.grad(ref(x).square().sum(), [x, ref.alpha_p, ref.alpha_n])
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, {}), (torch.bfloat16, dict(atol=2e-2, rtol=2e-2))])
def test_eager_xielu_equals_the_formula_in_values_and_gradients(dtype, tol):
    torch.manual_seed(0)  # both sides of 0 and of ε, the band between them, far tails
    edges = torch.tensor([0.0, -0.0, -1e-6, -5e-7, -2e-6, 1e-7, -40.0, 9.0])
    x = torch.cat([torch.randn(5000) * 4, edges]).to(dtype).requires_grad_()
    ap, an = (torch.tensor([v], dtype=dtype, requires_grad=True) for v in (0.3, -0.7))
    dy = torch.randn_like(x)
    ours, ref = xielu_eager(x, ap, an), xielu_reference(x, ap, an)
    assert torch.equal(ours, ref)  # each branch's ops in the formula's order
    for a, b in zip(torch.autograd.grad(ours, [x, ap, an], dy), torch.autograd.grad(ref, [x, ap, an], dy)):
        torch.testing.assert_close(a, b, **tol)


def test_cpu_xielu_runs_the_compiled_formula_and_equals_it_up_to_rounding():
    torch.manual_seed(0)
    edges = torch.tensor([0.0, -0.0, -1e-6, -5e-7, -2e-6, 1e-7, -40.0, 9.0])
    x = torch.cat([torch.randn(3, 5000) * 4, edges.expand(3, -1)], dim=1).requires_grad_()
    ap, an = (torch.tensor([v], requires_grad=True) for v in (0.3, -0.7))
    dy = torch.randn_like(x)
    ours, ref = xielu(x, ap, an), xielu_reference(x, ap, an)
    assert ran_compiled(ours)  # inductor's loop, not the eager ops
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    for a, b in zip(torch.autograd.grad(ours, [x, ap, an], dy), torch.autograd.grad(ref, [x, ap, an], dy)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)   # a_p, a_n: sums over 15,024 elements


def test_cpu_xielu_under_bf16_autocast_runs_the_compiled_formula_on_bf16_activations():
    torch.manual_seed(0)   # what a linear under CPU bf16 autocast hands xIELU: bf16 values that autograd records
    x = (torch.randn(3, 5000) * 4).bfloat16().requires_grad_()
    ap, an = (torch.tensor([v], requires_grad=True) for v in (0.3, -0.7))
    ours, ref = xielu(x, ap, an), xielu_reference(x.float(), ap, an)
    assert ran_compiled(ours)
    torch.testing.assert_close(ours.float(), ref, atol=2e-2, rtol=1e-2)   # the bf16 input's rounding only
    dy = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(ours, [x, ap, an], dy), torch.autograd.grad(ref, [x, ap, an], dy)):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=2e-2)


def ran_compiled(y: torch.Tensor) -> bool:
    "Whether y came out of a compiled graph (viewed back to its input's shape)."
    return any(f is not None and f.name().startswith("CompiledFunction") for f, _ in y.grad_fn.next_functions)


def test_cpu_xielu_trains_every_shape_compiled_and_infers_eagerly():
    ap, an = (torch.tensor([v], requires_grad=True) for v in (0.3, -0.7))   # more shapes than dynamo's limit of 8:
    shapes = [(4097,), (5000, 1), (1, 64, 97), (2, 32, 96), (2, 1, 4100), (1, 1, 3, 2000), (9000,), (3, 40, 50),
              (8, 256, 3), (2, 2, 2, 1100)]                                   # ranks 1-4, sizes of 1
    for shape in shapes:
        for mode in (torch.no_grad, torch.inference_mode):
            x = torch.randn(shape)
            with mode():
                assert torch.equal(xielu(x, ap, an), xielu_reference(x, ap, an))   # xielu_eager: bit for bit
        assert ran_compiled(xielu(torch.randn(shape, requires_grad=True), ap, an))
    assert not ran_compiled(xielu(torch.randn(64, 64, requires_grad=True), ap, an))   # 4,096 values: eager


def test_rms_norm_with_fused_gain_equals_gain_times_norm():
    torch.manual_seed(0)
    norm, x = RMSNorm(16), torch.randn(4, 16, requires_grad=True)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    unfused = norm.weight * (x / x.pow(2).mean(-1, keepdim=True).add(norm.eps).sqrt())
    torch.testing.assert_close(norm(x), unfused)
    for a, b in zip(torch.autograd.grad(norm(x).square().sum(), [x, norm.weight]),
                    torch.autograd.grad(unfused.square().sum(), [x, norm.weight])):
        torch.testing.assert_close(a, b)


def test_xielu_initial_slopes_are_published_values():
    act = XIELU()
    x = torch.tensor([2.0, -1e4])
    y = xielu_reference(x, act.alpha_p, act.alpha_n)
    assert y[0].item() == pytest.approx(0.8 * 4 + 0.5 * 2)            # α_p x² + β x with α_p = 0.8
    assert y[1].item() / -1e4 == pytest.approx(0.5 - 0.8, rel=1e-3)  # slope β − α_n far left, α_n = 0.8


def test_llama3_rope_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = hf_config(small(rope_theta=12e6, rope_scaling=LLAMA3, max_seq_len=256))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(16, 12e6, LLAMA3), expected)


@given(st.integers(0, 500), st.integers(0, 500), st.integers(1, 300))
@settings(max_examples=30, deadline=None)
def test_rope_scores_depend_only_on_distance(m, n, shift):
    torch.manual_seed(0)
    q, k, inv = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32), rope_inv_freq(32, 500_000.0)
    def score(a, b):
        ang = lambda p: torch.cat([p * inv, p * inv])  # noqa: E731
        return (apply_rope(q, ang(a).cos(), ang(a).sin()) * apply_rope(k, ang(b).cos(), ang(b).sin())).sum()
    assert score(m, n).item() == pytest.approx(score(m + shift, n + shift).item(), abs=1e-3)


# --- equivalence with transformers' ApertusForCausalLM ------------------------------------------------------------
@pytest.mark.parametrize("rope", ["plain", "llama3"])
def test_logits_match_transformers_apertus(rope):
    torch.manual_seed(1)
    kw = dict(rope_theta=12e6, rope_scaling=LLAMA3) if rope == "llama3" else {}
    ours = build(small(**kw, max_seq_len=128)).eval()
    with torch.no_grad():
        for layer in ours.layers:  # trained-looking xIELU and norm parameters, not the init
            layer.mlp.act_fn.alpha_p.normal_(), layer.mlp.act_fn.alpha_n.normal_()
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5), layer.attention_layernorm.weight.uniform_(0.5, 1.5)
    hf = to_hf(ours).eval()
    assert type(hf).__name__ == "ApertusForCausalLM"
    ids = torch.randint(0, 300, (3, 100))  # longer than original_max_position_embeddings: scaling matters
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-4


def test_save_pretrained_loads_with_automodel_and_round_trips_exactly(model, tmp_path):
    to_hf(model).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "ApertusForCausalLM"
    back = from_hf(loaded)
    assert back.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


def test_bf16_round_trip_through_transformers_is_exact(model):
    half = build(small(), dtype=torch.bfloat16)
    half.load_state_dict({k: v.bfloat16() for k, v in model.state_dict().items()})
    back = from_hf(to_hf(half))
    for (name, a), (_, b) in zip(half.state_dict().items(), back.state_dict().items()):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name


def test_checkpoint_with_other_xielu_constants_is_refused(model):
    hf = to_hf(model)
    with torch.no_grad():
        hf.model.layers[0].mlp.act_fn.beta.fill_(0.25)
    with pytest.raises(ValueError, match="beta"):
        from_hf(hf)


def test_variants_without_a_transformers_counterpart_are_refused():
    with pytest.raises(ValueError, match="Apertus variant"):
        hf_config(small(activation="swiglu"))


# --- masking, caching and decoding ----------------------------------------------------------------------------------
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_packed_row_equals_documents_run_separately(model, device):
    torch.manual_seed(2)
    model = model.to(device)
    docs = [torch.randint(0, 300, (n,), device=device) for n in (7, 12, 5)]
    doc_ids = torch.cat([torch.full((len(d),), i, device=device) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        packed = model(torch.cat(docs)[None], doc_ids=doc_ids)[0]
        alone = torch.cat([model(d[None])[0] for d in docs])
    model.cpu()
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_attention_never_crosses_documents(model):
    ids = torch.randint(0, 300, (1, 20))
    doc_ids = torch.tensor([[0] * 10 + [1] * 10])
    changed = ids.clone()
    changed[0, :10] = torch.randint(0, 300, (10,))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, doc_ids=doc_ids)[0, 10:], model(changed, doc_ids=doc_ids)[0, 10:])


@given(st.lists(st.integers(1, 6), min_size=1, max_size=6))
def test_document_positions_restart_at_each_boundary(lengths):
    doc_ids = torch.cat([torch.full((n,), i % 2) for i, n in enumerate(lengths)])[None]  # ids may repeat
    expected = [p for n in lengths for p in range(n)]
    assert document_positions(doc_ids)[0].tolist() == expected


@pytest.mark.parametrize("device", DEVICES)
def test_cached_decoding_equals_full_recomputation(model, device):
    model = model.to(device)
    ids = torch.randint(0, 300, (2, 20), device=device)
    cache = model.init_cache(2, 20)
    with torch.no_grad():
        full = model(ids)
        steps = [model(ids[:, :8], cache=cache), model(ids[:, 8:13], cache=cache)]
        steps += [model(ids[:, t:t + 1], cache=cache) for t in range(13, 20)]
    model.cpu()
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.pos == 20


def test_cache_bytes_per_token_equals_allocated_cache(model):
    cache = model.init_cache(1, 50, dtype=torch.bfloat16)
    allocated = sum(t.nbytes for t in cache.k + cache.v)
    assert cache_bytes_per_token(model.config, torch.bfloat16) * 50 == allocated
    assert cache_bytes_per_token(DenseConfig()) == 2 * 32 * 8 * 128 * 2  # Apertus-8B: 128 KiB per token


def test_cache_overflow_is_a_clear_error():
    cache = KVCache(1, 1, 4, 1, 2)
    with pytest.raises(ValueError, match="KV cache full"):
        cache.update(0, torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2))


def test_greedy_generate_equals_argmax_of_full_recomputation(model):
    prompt = torch.randint(0, 300, (2, 5))
    out = generate(model, prompt, 8)
    seq = prompt
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


@pytest.mark.parametrize("device", DEVICES)
def test_nucleus_sampling_is_seeded_and_stays_in_the_nucleus(model, device):
    model = model.to(device)
    prompt = torch.randint(0, 300, (2, 4), device=device)
    a = generate(model, prompt, 10, temperature=1.0, top_p=0.9, seed=3)
    assert torch.equal(a, generate(model, prompt, 10, temperature=1.0, top_p=0.9, seed=3))
    model.cpu()
    logits = torch.log(torch.tensor([[0.6, 0.25, 0.1, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits, 1.0, 0.8, g) for _ in range(500)])
    assert set(draws.unique().tolist()) == {0, 1}  # 0.6 < 0.8 ≤ 0.85: the nucleus is {0, 1}
    assert (draws == 0).float().mean().item() == pytest.approx(0.6 / 0.85, abs=0.07)


def test_generate_pads_with_eos_after_a_row_ends(model):
    prompt = torch.randint(0, 300, (1, 3))
    first = generate(model, prompt, 1)[0, -1].item()
    out = generate(model, prompt, 5, eos_id=first)
    assert out[0, 3:].tolist() == [first] * 5


def test_bf16_forward_runs_and_stays_close_to_fp32(model):
    ids = torch.randint(0, 300, (1, 16))
    half = build(small(), dtype=torch.bfloat16)
    half.load_state_dict({k: v.bfloat16() for k, v in model.state_dict().items()})
    with torch.no_grad():
        diff = (half(ids).float() - model(ids)).abs().max().item()
    assert diff < 0.1 * model(ids).abs().max().item()
    assert math.isfinite(diff)


def test_sampling_leaves_the_global_rng_alone(model):
    prompt = torch.randint(0, 300, (1, 3))
    torch.manual_seed(5)
    generate(model, prompt, 4, temperature=1.0)  # unseeded: draws from its own generator only
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(3), after)


def test_packed_documents_with_a_filled_cache_are_refused(model):
    cache = model.init_cache(1, 16)
    with torch.no_grad():
        model(torch.randint(0, 300, (1, 4)), cache=cache)
        with pytest.raises(ValueError, match="KV cache"):
            model(torch.randint(0, 300, (1, 4)), doc_ids=torch.tensor([[0, 0, 1, 1]]), cache=cache)


@pytest.mark.slow
def test_compiled_blocks_equal_the_eager_model():
    torch.manual_seed(0)
    eager = build(small())
    fused = build(small(), compile=True)
    fused.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 300, (2, 32))
    torch.testing.assert_close(fused(ids), eager(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs,field", [
    (dict(prompt_ids=torch.zeros(1, 0, dtype=torch.long)), "prompt_ids"),
    (dict(prompt_ids=torch.zeros(0, 3, dtype=torch.long)), "prompt_ids"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(max_new_tokens=62), "max_seq_len"),  # 3 + 62 > 64
])
def test_generate_refuses_bad_arguments_naming_them(model, kwargs, field):
    args = {"prompt_ids": torch.zeros(1, 3, dtype=torch.long), "max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=field):
        generate(model, **args)


def test_generate_fills_the_context_exactly(model):
    out = generate(model, torch.zeros(1, 3, dtype=torch.long), 61)  # 3 + 61 = max_seq_len 64
    assert out.shape == (1, 64)


@pytest.mark.parametrize("change,field", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="silu"), "hidden_act"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
])
def test_from_hf_refuses_what_dense_lm_cannot_represent(model, change, field):
    config = hf_config(model.config)
    for key, value in change.items():
        setattr(config, key, value)
    hf = transformers.ApertusForCausalLM(config)
    with pytest.raises(ConfigError, match=field):
        from_hf(hf)


@pytest.mark.parametrize("change,field", [
    (dict(head_dim=15), "head_dim"),                       # RoPE rotates pairs of channels
    (dict(d_model=0), "d_model"),
    (dict(n_layers=-2), "n_layers"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(n_kv_heads=0), "n_kv_heads"),
    (dict(mlp_hidden=-1), "mlp_hidden"),
    (dict(n_heads=3, n_kv_heads=2), "n_kv_heads"),
    (dict(rope_scaling=dict(factor=8.0)), "rope_scaling"),  # partial Llama-3 scaling
    (dict(rope_scaling={**LLAMA3, "factor": 0.0}), "rope_scaling.factor"),
    (dict(rope_scaling={**LLAMA3, "high_freq_factor": 1.0}), "high_freq_factor"),
])
def test_config_refuses_impossible_shapes_naming_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        small(**change)
