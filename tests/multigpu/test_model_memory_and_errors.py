"""At tp 2 (gloo): a bf16 checkpoint's peak RSS per rank, and unsupported configs failing on every rank.

Memory: each rank loads its shard of a bf16 checkpoint at bf16; its peak RSS
must stay within ``1.3 x shard bytes + baseline`` (baseline: the process
after its imports, peak counter reset with ``/proc/self/clear_refs``).  The
figures are printed.  Startup errors: an unsupported mixture-of-experts config (Qwen2-MoE) and an
unknown RoPE type make ``build_engine`` raise the same one-line
``ValueError`` on both ranks, before any collective (nothing hangs).
"""

import json
from pathlib import Path

import pytest
import torch

from tpguide.dist.spawn import run_on_ranks
from tpguide.model.random_checkpoint import write_random_model

RSS_FACTOR = 1.3


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _memory_and_errors(group, bf16_dir, broken_dirs):
    import gc

    from tpguide.engine import EngineConfig, build_engine
    from tpguide.model.config import ModelConfig
    from tpguide.model.loader import load_model

    errors = {}
    for name, d in broken_dirs.items():
        try:
            build_engine(group, d, EngineConfig(max_model_len=64))
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)
    ModelConfig.from_pretrained(bf16_dir)  # imports what loading imports
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    baseline = _kib("VmRSS")
    model = load_model(bf16_dir, group, dtype=torch.bfloat16)
    peak = _kib("VmHWM")
    shard = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    dtypes = {str(p.dtype) for p in model.parameters()}
    return errors, {"baseline": baseline, "peak": peak, "shard": shard, "dtypes": dtypes}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("mem")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    bf16 = write_random_model(root / "bf16", cfg, dtype=torch.bfloat16)
    broken = {}
    for name, config in {
        "moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 64,
                "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_experts": 4, "vocab_size": 1000},
        "rope": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                 "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000,
                 "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    }.items():
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        broken[name] = str(d)
    return str(bf16), broken


def test_bf16_peak_rss_and_startup_errors_on_every_rank(dirs):
    bf16_dir, broken = dirs
    results = run_on_ranks(_memory_and_errors, 2, bf16_dir, broken, timeout_s=300)
    for rank, (errors, mem) in enumerate(results):
        assert errors["moe"].startswith("unsupported model: Qwen2MoeForCausalLM is a mixture-of-experts model")
        assert "supported architectures: LlamaForCausalLM" in errors["moe"]
        assert "rope_type 'dynamic' is not supported; supported: " in errors["rope"]
        assert all("\n" not in e for e in errors.values())
        limit = RSS_FACTOR * mem["shard"] + mem["baseline"]
        print(f"rank {rank}: bf16 shard {mem['shard'] / 2**20:.1f} MiB, baseline RSS {mem['baseline'] / 2**20:.1f} "
              f"MiB, peak RSS {mem['peak'] / 2**20:.1f} MiB (growth {(mem['peak'] - mem['baseline']) / mem['shard']:.2f}"
              f"x shard), limit {limit / 2**20:.1f} MiB")
        assert mem["dtypes"] == {"torch.bfloat16"}
        assert mem["peak"] <= limit
