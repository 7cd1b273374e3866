"""The decoder stack as one C call gives the per-op path's logits bit for bit, and steps aside when it cannot."""

import os
import subprocess
import sys

import pytest
import torch
from decoder_steps import BLOCK, A, run_steps

import tpguide.model.decoder_stack_cpu as stack_module
from tpguide.dist import TPGroup
from tpguide.model.attention import AttentionMetadata
from tpguide.model.invariant_reduce import prepack_weights
from tpguide.model.loader import load_model
from tpguide.model.random_checkpoint import write_random_checkpoint

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # intermediate 193: the down projection's unit is odd, so the bf16 pair layout pads it (K_pad 194)
    return write_random_checkpoint(tmp_path_factory.mktemp("stack"), vocab_size=VOCAB, intermediate_size=193, seed=5)


def _logits(model, stacked: bool, calls=None):
    model.model.use_decoder_stack = stacked
    start, out = len(calls or []), []
    for step, logits in enumerate(run_steps(model), 1):
        out.append(logits)
        assert calls is None or len(calls) == start + stacked * step  # the one call ran exactly when asked for
    return out


@pytest.fixture
def calls(monkeypatch):
    seen = []
    real = stack_module.run_decoder_layers

    def counted(*args, **kwargs):
        result = real(*args, **kwargs)
        seen.append(result is not None)
        return result

    monkeypatch.setattr(stack_module, "run_decoder_layers", counted)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prepacked", [False, True], ids=["packed-on-use", "held-once"])
def test_stack_call_equals_per_op(ckpt, calls, dtype, prepacked):
    model = load_model(ckpt, TPGroup(), dtype=dtype)
    if prepacked:
        prepack_weights(model)
    assert model.model.decoder_stack_cpu() is not None
    stacked = _logits(model, True, calls)
    per_op = _logits(model, False, calls)
    again = _logits(model, True, calls)  # a new cache: the descriptions follow it
    assert all(calls)  # every stack call finished (none fell back)
    for s, p, a in zip(stacked, per_op, again):
        assert torch.equal(s, p) and torch.equal(a, p)


def test_stack_call_equals_per_op_on_avx2(ckpt):
    """bf16 on the AVX2 class: the fmaf panels, the bf16 input widened in C (another process)."""
    script = f"""
import torch, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_decoder_stack_cpu import _logits
from tpguide.dist import TPGroup
from tpguide.model.loader import load_model
from tpguide.kernels.fixed_order_cpu import kernel_isa
model = load_model({str(ckpt)!r}, TPGroup(), dtype=torch.bfloat16)
assert kernel_isa() == "avx2", kernel_isa()
assert model.model.decoder_stack_cpu() is not None
a, b = _logits(model, True), _logits(model, False)
assert all(torch.equal(x, y) for x, y in zip(a, b))
print("same")
"""
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "same" in proc.stdout, proc.stderr[-2000:]


def test_models_the_call_does_not_run_keep_the_per_op_path(tmp_path):
    biased = load_model(write_random_checkpoint(tmp_path / "bias", vocab_size=VOCAB, attention_bias=True),
                        TPGroup())
    assert biased.model.decoder_stack_cpu() is None  # q/k/v biases: not in the call
    plain = write_random_checkpoint(tmp_path / "plain", vocab_size=VOCAB)
    assert load_model(plain, TPGroup(), tp_invariant=False).model.decoder_stack_cpu() is None


def test_a_refused_step_raises_the_per_op_error(ckpt, calls):
    model = load_model(ckpt, TPGroup(), dtype=torch.bfloat16)
    model.allocate_kv_cache(3, BLOCK, 32)
    meta = AttentionMetadata.from_block_tables([[0, 7]], [6], [0], block_size=BLOCK)  # block 7 of 3
    with pytest.raises(ValueError, match="cache rows must lie in"):
        model(torch.tensor(A[:6]), meta.token_positions, meta)
    assert calls == [False]  # the C call refused, then the per-op path named the row


def _edited(ckpt, tmp_path, **fields):
    import json
    import shutil

    out = shutil.copytree(ckpt, tmp_path / "edited")
    config = json.loads((out / "config.json").read_text())
    config.update(fields)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("fields", [
    {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 5},
    {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}},
], ids=["mistral-sliding-window", "partial-rotary"])
def test_stack_call_equals_per_op_with_windows_and_partial_rotary(ckpt, calls, tmp_path, fields):
    model = load_model(_edited(ckpt, tmp_path, **fields), TPGroup(), dtype=torch.bfloat16)
    attn = model.model.layers[0].self_attn
    assert attn.attn.sliding_window == fields.get("sliding_window")
    assert (attn.rotary_emb.rotary_dim < attn.qkv_proj.head_dim) == ("rope_parameters" in fields)
    stacked, per_op = _logits(model, True, calls), _logits(model, False, calls)
    assert calls and all(calls)
    for s, p in zip(stacked, per_op):
        assert torch.equal(s, p)


def test_mismatched_inputs_and_a_new_cache(ckpt, calls):
    import gc
    import weakref

    model = load_model(ckpt, TPGroup(), dtype=torch.bfloat16)
    model.allocate_kv_cache(9, BLOCK, 32)
    meta = AttentionMetadata.from_block_tables([[0, 1]], [6], [0], block_size=BLOCK)
    model(torch.tensor(A[:6]), meta.token_positions, meta)
    old = weakref.ref(model.model.layers[0].self_attn.attn.k_cache)
    model.allocate_kv_cache(9, BLOCK, 32)
    gc.collect()
    assert old() is None  # the stack does not hold the pool it last described
    with pytest.raises(RuntimeError):  # 5 positions for 6 tokens: the per-op path refuses, the stack stepped aside
        model(torch.tensor(A[:6]), meta.token_positions[:5], meta)
    assert calls == [True]
