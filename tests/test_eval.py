"""`inferd eval` on the default model, small: the numbers exist, are sane, and order as they must."""

import torch

from inferd.eval import compare


def test_compare_identity_and_shift():
    lp = torch.log_softmax(torch.randn(9, 50), -1)
    t = torch.randint(0, 50, (8,))
    d = compare(lp, lp, t)
    assert float(d["kl"].max()) < 1e-6 and float(d["agree"].mean()) == 1.0
    other = torch.log_softmax(torch.randn(9, 50), -1)
    d2 = compare(lp, other, t)
    assert float(d2["kl"].mean()) > 0.1
    # KL by hand for one row
    p = lp[0].exp()
    assert abs(float((p * (lp[0] - other[0])).sum()) - float(d2["kl"][0])) < 1e-5


# the CLI itself: tests/test_readme.py runs the README's `inferd eval` command and checks its numbers


def test_table_fits_long_names_and_has_no_speed_columns_without_speed():
    from inferd.eval import format_table

    row = {"config": "int4-gptq W4A8 +lm_head float32 act", "perplexity": 26.2, "mean_kl": 0.003, "p99_kl": 0.01,
           "top1_agreement": 0.966, "weight_mib": 92, "continuations": ["x"]}
    res = {"model": "m", "windows": 2, "ctx": 64, "note": "Q4_1", "prompts": ["p"], "reference_continuations": ["x"],
           "reference": {"config": "reference (fp32, dequantized)", "perplexity": 26.1, "weight_mib": 513},
           "configs": [row]}
    lines = format_table(res).splitlines()
    assert "nan" not in format_table(res) and "tok/s" not in lines[2]
    assert lines[2].index("ppl") + 3 == lines[5].index("26.200") + 6  # columns stay aligned under their heads
    row.update(decode_tok_s_batch1=120.0, throughput_tok_s_batch32=600.0)
    assert "b32 tok/s" in format_table(res).splitlines()[2] and "600.0" in format_table(res)


def test_kv_cache_rows_run_the_paged_kernels_and_are_tabled():
    """--kv-cache-dtype rows: a window through the paged cache equals the plain row's logprobs with a
    float32 cache and stays close with an int8 one (the kernels read it; the torch fallback would be
    an error, not a silent row); the cache-alone table lists each row against the first KV dtype."""
    import pytest
    from conftest import make_tiny_model

    from inferd.eval import format_table, paged_window_logprobs, window_logprobs
    from inferd.kernels import native

    model = make_tiny_model().model
    w = list(range(3, 3 + 200))
    plain = window_logprobs(model, w)
    if native.load() is None:
        with pytest.raises(Exception, match="torch fallback"):
            paged_window_logprobs(model, w, "int8")
    else:
        torch.testing.assert_close(paged_window_logprobs(model, w, "float32"), plain, atol=2e-5, rtol=0)
        q8 = paged_window_logprobs(model, w, "int8")
        d = compare(plain, q8, torch.tensor(w[1:]))
        assert float(d["kl"].mean()) < 1e-3 and float(d["agree"].float().mean()) > 0.95
    rows = [{"config": f"none float32 act, KV {kv}", "perplexity": 20.0, "mean_kl": 0.001, "p99_kl": 0.01,
             "top1_agreement": 0.99, "weight_mib": 1, "kv_cache_dtype": kv} for kv in ("bfloat16", "int8")]
    rows[1]["vs_first_kv"] = {"kv_cache_dtype": "bfloat16", "mean_kl": 0.0007, "p99_kl": 0.004, "top1_agreement": 0.985}
    rows[0]["continuations"] = ["x"]
    res = {"model": "m", "windows": 1, "ctx": 200, "note": "", "prompts": ["p"], "reference_continuations": ["x"],
           "reference": {"config": "reference", "perplexity": 20.0, "weight_mib": 1}, "configs": rows}
    table = format_table(res)
    assert "KV cache alone" in table and "98.5%" in table and "0.0007" in table
    assert "    none float32 act: 'x'" in table  # the continuations are the weights' (a contiguous cache)
