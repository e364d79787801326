"""The command line as a user meets it: real subprocesses, real exit codes, one-line errors."""
import json
import subprocess
import sys

import pytest


def run_cli(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "inferd", *args], capture_output=True, text=True,
                          input=stdin, timeout=timeout)


def assert_one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n.lower() in lines[0].lower(), lines[0]


@pytest.mark.slow
def test_generate_paris_without_transformers():
    code = (
        "import sys\n"
        "from inferd.cli import main\n"
        "rc = main(['generate', '--prompt', 'The capital of France is', '--max-tokens', '8',"
        " '--temperature', '0', '--dtype', 'float32'])\n"
        "assert rc == 0, rc\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_missing_file():
    assert_one_line_error(run_cli("generate", "--model", "/nonexistent/model.gguf", "--prompt", "x"), "not found")


def test_non_gguf_file(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("hello, this is not a model")
    assert_one_line_error(run_cli("generate", "--model", str(p), "--prompt", "x"), "not a GGUF")


def test_truncated_gguf(tmp_path):
    from inferd.loading.loader import default_model_path

    p = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as f:
        p.write_bytes(f.read(4096))
    assert_one_line_error(run_cli("generate", "--model", str(p), "--prompt", "x"), "cut.gguf")


def test_truncated_tensor_data(tmp_path):
    from inferd.loading.loader import default_model_path

    p = tmp_path / "half.gguf"
    with open(default_model_path(), "rb") as f:
        data = f.read()
    p.write_bytes(data[: len(data) // 2])
    assert_one_line_error(run_cli("generate", "--model", str(p), "--prompt", "x"), "half.gguf")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert_one_line_error(run_cli("generate", "--model", str(tmp_path), "--prompt", "x"), "unsupported architecture")


def test_unsupported_gguf_architecture(tmp_path):
    from gguf import GGUFWriter
    import numpy as np

    w = GGUFWriter(str(tmp_path / "m.gguf"), "falcon")
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert_one_line_error(run_cli("generate", "--model", str(tmp_path / "m.gguf"), "--prompt", "x"),
                          "unsupported architecture")


def test_hub_id_without_local_files():
    assert_one_line_error(run_cli("generate", "--model", "meta-llama/Llama-3.2-1B", "--prompt", "x"),
                          "not found locally")


def test_unknown_dtype():
    assert_one_line_error(run_cli("generate", "--dtype", "float7", "--prompt", "x"), "dtype")


def test_cuda_unavailable():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert_one_line_error(run_cli("generate", "--device", "cuda", "--prompt", "x"), "CUDA is not available")


@pytest.mark.slow
def test_dummy_builtin_shapes():
    code = (
        "from inferd.loading.loader import load_model\n"
        "lm = load_model('qwen2.5-0.5b', load_format='dummy', dtype='bfloat16', with_tokenizer=False)\n"
        "n = sum(p.numel() for p in lm.model.parameters())\n"
        "print(n)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # Qwen2.5-0.5B: 494M parameters with its embedding tied
    assert 490e6 < int(r.stdout) < 500e6


def test_serve_yaml_config_unknown_key(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: smollm2-135m\nmax_num_seqz: 4\n")
    assert_one_line_error(run_cli("serve", "--config", str(cfg)), "unknown key", "max_num_seqz")


def test_serve_yaml_config_and_flag_override(tmp_path):
    from inferd.cli import apply_yaml_config, build_parser

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: smollm2-135m\nquantization: none\ndtype: float32\ngpu_memory_utilization: 0.8\n"
                   "max-num-seqs: 7\nmax_num_batched_tokens: 128\nport: 9001\n")
    p = build_parser()
    argv = ["serve", "--config", str(cfg), "--max-num-seqs", "3"]
    args = apply_yaml_config(p, argv, p.parse_args(argv))
    assert args.max_num_seqs == 3  # the flag wins
    assert args.max_num_batched_tokens == 128 and args.dtype == "float32" and args.port == 9001
    assert args.gpu_memory_utilization == 0.8 and args.model == ["smollm2-135m"]  # serve's --model repeats
    argv = ["serve", "--config", str(cfg), "--model", "other.gguf"]
    assert apply_yaml_config(p, argv, p.parse_args(argv)).model == ["other.gguf"]  # replaced, not appended
