"""The mixture-of-experts block in one process: routing rule, dispatch modes, checkpoint layouts, configs, shards.

TP equality with transformers is in ``tests/multigpu/test_architectures_tp.py``;
bit-exactness across tp, batch, chunking and drafts in
``tests/multigpu/test_moe_exactness.py``.
"""

import pytest
import torch
from safetensors.torch import save_file

from tpguide.dist import TPGroup
from tpguide.model.attention import AttentionMetadata
from tpguide.model.config import ModelConfig
from tpguide.model.loader import load_model
from tpguide.model.moe import SparseMoeBlock, expert_weight_bytes
from tpguide.model.moe_router import select_experts
from tpguide.model.random_checkpoint import tiny_hf_config, write_random_model

VOCAB = 500


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{arch: dir}``: the tiny Qwen3-MoE and Mixtral as ``save_pretrained`` writes them (one expert per tensor)."""
    return {arch: write_random_model(tmp_path_factory.mktemp(arch), tiny_hf_config(arch, VOCAB), seed=5)
            for arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM")}


def _logits(model, ids):
    meta = AttentionMetadata.from_lists([0], [len(ids)], [0])
    return model.compute_logits(model(torch.tensor(ids), meta.token_positions, meta))


def test_top_k_ties_go_to_the_lowest_expert_id_and_weights_follow_the_family():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0],  # a three-way tie for the top: experts 1 and 2
                           [2.0, 0.0, 5.0, 0.0, 2.0],  # a tie for second place: expert 0 before 4
                           [0.0, 0.0, 0.0, 0.0, 0.0]])  # all equal: experts 0 and 1
    ids, weights = select_experts(logits, 2, norm_topk_prob=False)
    assert ids.tolist() == [[1, 2], [0, 2], [0, 1]]
    probs = torch.softmax(logits, dim=-1)
    assert torch.equal(weights, torch.gather(probs, 1, ids))
    ids_n, norm = select_experts(logits, 2, norm_topk_prob=True)
    assert torch.equal(ids_n, ids) and torch.allclose(norm.sum(-1), torch.ones(3))
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(64, 16, generator=g).to(torch.bfloat16)
    ids, weights = select_experts(rand, 4, norm_topk_prob=True)
    top = torch.topk(torch.softmax(rand.float(), -1), 4)  # no ties in random rows: the same set as torch.topk
    assert torch.equal(ids, top.indices.sort(-1).values)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and bool((ids.diff(dim=-1) > 0).all())
    with pytest.raises(ValueError, match=r"top_k=17 must be in \[1, num_experts=16\]"):
        select_experts(rand, 17, True)


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def test_all_rows_dispatch_has_the_bits_of_grouped_dispatch(arch, checkpoints):
    """The capturable dispatch (every expert over every row) changes no bit of the grouped one, fp32 and bf16."""
    ids = torch.randint(0, VOCAB, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(checkpoints[arch], TPGroup(), dtype)
        model.allocate_kv_cache(1, 32)
        grouped = _logits(model, ids)
        blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        assert len(blocks) == len(model.config.moe_layers) >= 2
        empty = torch.zeros(0, model.config.hidden_size, dtype=dtype)
        assert blocks[0](empty).shape == empty.shape  # a step without rows
        for block in blocks:
            block.dispatch = "all_rows"
        assert torch.equal(_logits(model, ids), grouped), (arch, dtype)
        assert blocks[0](empty).shape == empty.shape
        blocks[0].dispatch = "sorted"
        with pytest.raises(ValueError, match="dispatch must be one of"):
            _logits(model, ids)


def _fused_copy(src, dst):
    """``src``'s weights as transformers 5 holds them in memory (experts fused into 3D tensors), saved as is."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") and v.dim() == 3 for k, v in state.items())
    dst.mkdir()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def test_fused_expert_checkpoint_loads_the_shards_of_the_per_expert_one(arch, checkpoints, tmp_path):
    """Both layouts give every rank of tp 2 the same parameters; a rank holds half of each expert."""
    from safetensors import safe_open

    fused = _fused_copy(checkpoints[arch], tmp_path / "fused")
    with safe_open(str(fused / "model.safetensors"), "pt") as f:
        assert not any(".experts.0." in k or "block_sparse_moe" in k for k in f.keys())
    whole = expert_weight_bytes(load_model(checkpoints[arch], TPGroup()))
    for rank in (0, 1):
        group = TPGroup(tp_rank=rank, tp_size=2, process_group=object())
        a, b = load_model(checkpoints[arch], group), load_model(fused, group)
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        assert pa.keys() == pb.keys()
        assert all(torch.equal(pa[k], pb[k]) for k in pa), [k for k in pa if not torch.equal(pa[k], pb[k])]
        assert 2 * expert_weight_bytes(a) == whole  # 1/tp of every expert's gate, up and down


def test_moe_configs_layers_tp_sizes_and_refusals(checkpoints, tmp_path):
    q = ModelConfig.from_pretrained(checkpoints["Qwen3MoeForCausalLM"])
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size, q.norm_topk_prob) == (8, 2, 48, False)
    assert q.moe_layers == (0, 2) and q.qk_norm and not q.router_weights_fp32  # layer 1 in mlp_only_layers
    m = ModelConfig.from_pretrained(checkpoints["MixtralForCausalLM"])
    assert m.moe_layers == (0, 1) and m.norm_topk_prob and m.router_weights_fp32
    assert m.moe_intermediate_size == m.intermediate_size and set(m.layer_types) == {"sliding_attention"}
    step = ModelConfig.from_hf(tiny_hf_config("Qwen3MoeForCausalLM", VOCAB, num_hidden_layers=4,
                                              decoder_sparse_step=2, mlp_only_layers=[]))
    assert step.moe_layers == (1, 3)
    odd = ModelConfig.from_hf(tiny_hf_config("Qwen3MoeForCausalLM", VOCAB, moe_intermediate_size=50))
    assert odd.valid_tp_sizes(4) == [1, 2]
    with pytest.raises(ValueError, match="moe_intermediate_size=50 is not divisible by tp_size=3"):
        odd.check_tp_size(3)
    from transformers import Qwen2MoeConfig

    with pytest.raises(ValueError, match="Qwen2MoeForCausalLM is a mixture-of-experts model.*the mixtures of experts "
                                         "tpguide runs are Qwen3MoeForCausalLM, MixtralForCausalLM"):
        ModelConfig.from_hf(Qwen2MoeConfig(architectures=["Qwen2MoeForCausalLM"]))


def test_a_missing_or_misshapen_expert_tensor_is_named(checkpoints, tmp_path):
    from safetensors.torch import load_file

    src = checkpoints["MixtralForCausalLM"]
    state = load_file(str(src / "model.safetensors"))
    for case, edit in (("missing", lambda s: s.pop("model.layers.1.block_sparse_moe.experts.7.w3.weight")),
                       ("shape", lambda s: s.update({"model.layers.0.block_sparse_moe.experts.2.w2.weight":
                                                     torch.zeros(64, 95)}))):
        d = tmp_path / case
        d.mkdir()
        broken = dict(state)
        edit(broken)
        save_file(broken, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text((src / "config.json").read_text())
        match = (r"lacks 1 tensors: model\.layers\.1\.block_sparse_moe\.experts\.7\.w3\.weight" if case == "missing"
                 else r"experts\.2\.w2\.weight.*shape \[64, 95\], the config expects \[64, 96\]")
        with pytest.raises(ValueError, match=match):
            load_model(d, TPGroup())


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def test_plain_mode_equals_the_exact_mode_within_rounding(arch, checkpoints):
    """Without ``tp_invariant`` (library matmuls, one all-reduce of the weighted sum): the same logits up to rounding."""
    ids = torch.randint(0, VOCAB, (19,), generator=torch.Generator().manual_seed(4)).tolist()
    got = {}
    for exact in (True, False):
        model = load_model(checkpoints[arch], TPGroup(), tp_invariant=exact)
        model.allocate_kv_cache(1, 32)
        got[exact] = _logits(model, ids)
    torch.testing.assert_close(got[False], got[True], atol=1e-4, rtol=0)
