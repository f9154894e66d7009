"""Serving (chapter 14): Soofi's Eq. 1 on synthetic timings, cache bytes against the built models, the hybrid's constant state."""
import pytest
import torch

from openpretrain.core import load_preset
from openpretrain.evaluation.serving import cache_bytes_at, cache_footprint, decode_tps, serving_sweep
from openpretrain.models.common import Attention
from openpretrain.models.registry import build_model, model_config


def test_decode_tps_is_extra_tokens_over_extra_time():
    # B = 32, O 1 → 1024: 32 · 1023 = 32,736 extra tokens in 10.5 − 0.27 = 10.23 s → 3,200 tok/s; two GPUs halve it
    assert decode_tps(32, 1, 1024, t_short=0.27, t_long=10.5) == pytest.approx(3200.0)
    assert decode_tps(32, 1, 1024, t_short=0.27, t_long=10.5, n_gpu=2) == pytest.approx(1600.0)
    assert decode_tps(4, 1, 33, t_short=1.0, t_long=3.0) == pytest.approx(64.0)  # 4 · 32 / 2


@pytest.mark.parametrize("t_short, t_long", [(2.0, 2.0), (3.0, 1.0), (-1.0, 1.0)])
def test_decode_tps_rejects_timings_that_do_not_grow(t_short, t_long):
    with pytest.raises(ValueError, match="t\\(O_long\\)"):
        decode_tps(32, 1, 1024, t_short, t_long)


@pytest.mark.parametrize("name", ["tiny", "tiny-hybrid", "apertus-8b", "soofi-30b-a3b"])
def test_kv_bytes_per_token_equal_the_key_value_projections_of_the_built_model(name):
    config = model_config(load_preset(name))
    model = build_model(config, device="meta", dtype=torch.bfloat16)
    # every attention layer stores its k_proj and v_proj outputs for each token, 2 bytes per bf16 value
    expected = sum(2 * (m.k_proj.out_features + m.v_proj.out_features)
                   for m in model.modules() if isinstance(m, Attention))
    assert cache_footprint(config)["kv_bytes_per_token"] == expected


def test_soofi_cache_is_6_kib_per_token():  # Soofi §4.3: "about 6 KB per token per sequence"
    assert cache_footprint(model_config(load_preset("soofi-30b-a3b")))["kv_bytes_per_token"] == 6 * 1024


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_hybrid_cache_grows_only_in_attention_layers():
    config = model_config(load_preset("tiny-hybrid"))
    model = build_model(config, dtype=torch.float32)
    sizes = {}
    for max_len in (64, 1024):
        cache = model.init_cache(batch=1, max_len=max_len)
        states = [s for s in cache.states if s is not None and s is not cache.kv]
        sizes[max_len] = (_bytes(cache.kv.k + cache.kv.v), _bytes(t for s in states for t in (s.conv, s.ssm)))
    assert len(cache.kv.k) == config.pattern.count("*")              # KV only in the attention layers
    assert sizes[64][1] == sizes[1024][1] > 0                        # the Mamba state does not grow with the context
    per_token = (sizes[1024][0] - sizes[64][0]) / (1024 - 64)
    assert per_token == cache_footprint(config, torch.float32)["kv_bytes_per_token"]
    assert sizes[1024][1] == cache_footprint(config, torch.float32)["state_bytes_per_sequence"]


def test_dense_cache_has_no_fixed_state():
    config = model_config(load_preset("tiny"))
    assert cache_bytes_at(config, 1000) == 1000 * cache_footprint(config)["kv_bytes_per_token"]


def test_serving_sweep_times_each_context_with_cached_decoding():
    model = build_model(model_config(load_preset("tiny-hybrid"))).eval()
    rows = serving_sweep(model, [8, 16], batch=2, o_long=33)  # 32 decode steps: well above timer noise under load
    assert [r["context"] for r in rows] == [8, 16]
    for r in rows:
        assert r["t_long_s"] > r["t_short_s"] > 0
        assert r["decode_tps"] == pytest.approx(2 * 32 / (r["t_long_s"] - r["t_short_s"]))


def test_a_sweep_that_cannot_fit_is_refused_before_allocating():
    import resource

    from openpretrain.core import ConfigError
    from openpretrain.evaluation.serving import ServingConfig, run_serving
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss                   # KiB
    hybrid = build_model(model_config(load_preset("tiny-hybrid"))).eval()      # no positional limit: memory decides
    with pytest.raises(ConfigError, match=r"serving.contexts: .*1000000000 tokens .* need at least .* GiB"):
        serving_sweep(hybrid, [16, 10**9], batch=1, o_long=4)
    dense = build_model(model_config(load_preset("tiny"))).eval()               # max_seq_len 256
    with pytest.raises(ConfigError, match="serving.contexts: 300 .* o_long 4 .* context limit 256"):
        serving_sweep(dense, [300], batch=1, o_long=4)
    cfg = ServingConfig(models=["tiny"], batch=1, o_long=4, contexts=[10**9])  # run_serving extends RoPE: memory decides
    with pytest.raises(ConfigError, match="serving.contexts"):
        run_serving(cfg, {"tiny": model_config(load_preset("tiny"))})
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 2**20   # under 1 GiB more at the peak
