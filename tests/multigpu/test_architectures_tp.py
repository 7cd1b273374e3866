"""Every supported family against transformers' own implementation, at tp 1, 2, 4 (and 3), in one gloo job.

Per architecture a tiny random-weight model is built with transformers
(:func:`tiny_hf_config`: 4 query heads in 2 KV groups, so tp 3 and tp 4 pad
whole zero KV groups; a sliding window of 8 tokens where the family has one;
longrope past 16 tokens for Phi-3; soft-caps for Gemma 2; local/global RoPE
bases for Gemma 3) with 49 160 LM-head rows against SmolLM2's 49 152-token
tokenizer (vocabulary padding, ids past the tokenizer never sampled).

One job of 4 ranks runs every architecture at tp 1 and 4, and Llama and
Phi-3 at tp 2 and 3 as well (:data:`TP_CASES`; sub-groups of ranks
``0..t-1``), and checks, against transformers in fp32:

* each rank's logits shard on a prompt longer than the window (and on a
  12-token prefix in a 12-token cache: Phi-3's short longrope factors)
  equals the matching slice of transformers' logits (atol 1e-4);
* 16 greedy tokens equal ``generate`` (EOS ignored, ids past the tokenizer
  suppressed, as tpguide masks them); the prompt is longer than Phi-3's
  original context, so transformers uses the long factors throughout, as
  tpguide does for a cache longer than that context (:mod:`tpguide.model.rotary`);
* a JSON-schema-guided greedy request gives identical tokens at each tp size.
"""


import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_on_ranks
from tpguide.model.attention import AttentionMetadata
from tpguide.model.hf_config import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from tpguide.model.random_checkpoint import TINY_SLIDING_WINDOW, tiny_hf_config, write_random_model

VOCAB = 49160  # LM-head rows; SmolLM2's tokenizer has 49152 ids
TOKENIZER_VOCAB = 49152
TP_SIZES = (1, 2, 3, 4)
#: tp sizes per family.  tp 1 (unsharded) and tp 4 (sharded, two zero KV groups, padded vocabulary) for every
#: family: a family's own layers (bias, windows, soft-caps, qk norms, RoPE variants) act per head, so they run
#: the same sharded code at every tp size.  tp 2 (no padding) and tp 3 (odd size: one zero KV group, 3-way
#: padded vocabulary) for Llama (the shared layers every family reuses), Phi-3 (fused ``qkv_proj`` /
#: ``gate_up_proj`` split per rank by its own loader) and the mixtures of experts (Qwen3-MoE, Mixtral).
#: The mixtures of experts at every tp size too: their experts are sharded and reduced by their own block.
TP_CASES = {arch: (1, 2, 3, 4) if arch in ("LlamaForCausalLM", "Phi3ForCausalLM") + MOE_ARCHITECTURES else (1, 4)
            for arch in SUPPORTED_ARCHITECTURES}
NUM_STEPS = 16
PROMPT = "The lighthouse keeper counted the ships that passed the rocky northern cape every night, and wrote each name in a book"
SHORT = 12  # a prefix within Phi-3's original context (short longrope factors)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def _requests():
    return [{"id": "greedy", "prompt": PROMPT, "max_tokens": NUM_STEPS, "ignore_eos": True},
            {"id": "json", "messages": [{"role": "user", "content": "A person as JSON"}],
             "structured_output": {"json": SCHEMA}, "max_tokens": 24}]


def _all_tp_sizes(group, model_dirs, prompt_ids):
    """On 4 ranks: every case of :data:`TP_CASES` (tp ``t`` on ranks ``0..t-1``); returns ``{(arch, t): results}``.

    Per case one model shard is loaded: its logits shards are taken, then an
    :class:`Engine` runs the requests on that same shard (what
    :func:`~tpguide.engine.startup.build_engine` builds).  The tokenizer is
    loaded once: every checkpoint carries SmolLM2's tokenizer files.
    """
    import json

    import torch.distributed as dist

    from tpguide.dist import group as C
    from tpguide.engine import EngineConfig
    from tpguide.engine.request_io import parse_request_lines
    from tpguide.engine.startup import start_engine
    from tpguide.model.loader import load_model
    from tpguide.model.tokenizer_facts import collect_stop_token_ids, producible_vocab_size

    rank = group.tp_rank
    groups = {1: TPGroup()} if rank == 0 else {}
    for t in TP_SIZES[1:]:
        pg = dist.new_group(list(range(t)))  # collective over all 4 ranks
        if rank < t:
            groups[t] = TPGroup(tp_rank=rank, tp_size=t, device=group.device, process_group=pg, backend="gloo")
    tokenizer = None
    if rank == 0:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(next(iter(model_dirs.values())))
        assert producible_vocab_size(tokenizer) == TOKENIZER_VOCAB
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=256, max_model_len=96)
    out = {}
    for arch, model_dir in model_dirs.items():
        stop_ids = collect_stop_token_ids(tokenizer, model_dir) if rank == 0 else None
        for t, g in groups.items():
            if t not in TP_CASES[arch]:
                continue
            model = load_model(model_dir, g, tokenizer_vocab_size=TOKENIZER_VOCAB)
            shards = []
            for ids, max_model_len in ((prompt_ids, 96), (prompt_ids[:SHORT], SHORT)):  # Phi-3: long, short factors
                model.allocate_kv_cache(1, max_model_len)
                meta = AttentionMetadata.from_lists([0], [len(ids)], [0])
                shards.append(model.compute_logits(model(torch.tensor(ids), meta.token_positions, meta)))
            shard = torch.cat(shards)  # [P + SHORT, V/t]
            engine = start_engine(model, g, config, tokenizer=tokenizer if g.is_driver else None,
                                  stop_token_ids=stop_ids)
            outputs = None
            if g.is_driver:
                requests = parse_request_lines([json.dumps(r) for r in _requests()], 64)
                outputs = [o.to_json() for o in engine.generate(requests)]
                engine.shutdown()
            else:
                engine.run_worker()
            outputs = C.broadcast_object(outputs, g)
            out[(arch, t)] = (shard.numpy(), (model.vocab_shard.vocab_start_index, model.vocab_shard.vocab_end_index),
                              {o["id"]: o["token_ids"] for o in outputs})
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, default_model_path):
    """``{arch: (model_dir, hf_logits [P + SHORT, VOCAB], hf_greedy_ids)}`` and the prompt ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    assert len(prompt_ids) > 16 > SHORT > TINY_SLIDING_WINDOW  # window; Phi-3's long and short factors
    refs = {}
    for seed, arch in enumerate(SUPPORTED_ARCHITECTURES):
        d = tmp_path_factory.mktemp(arch)
        write_random_model(d, tiny_hf_config(arch, VOCAB, tokenizer_dir=default_model_path), seed=seed,
                           tokenizer_dir=default_model_path)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            logits = torch.cat([hf(ids).logits[0], hf(ids[:, :SHORT]).logits[0]])  # [P + SHORT, VOCAB]
            gen = hf.generate(ids, max_new_tokens=NUM_STEPS, do_sample=False, pad_token_id=0,
                              suppress_tokens=list(range(TOKENIZER_VOCAB, VOCAB)))
        refs[arch] = (str(d), logits, gen[0, len(prompt_ids):].tolist())
    return refs, prompt_ids


@pytest.fixture(scope="module")
def tp_results(checkpoints):
    refs, prompt_ids = checkpoints
    per_rank = run_on_ranks(_all_tp_sizes, 4, {a: r[0] for a, r in refs.items()}, prompt_ids, timeout_s=900)
    return per_rank


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_logits_shards_greedy_and_guided_equal_transformers(arch, checkpoints, tp_results):
    refs, _ = checkpoints
    _, hf_logits, hf_greedy = refs[arch]
    guided = {}
    for t in TP_CASES[arch]:
        for rank in range(t):
            shard, (start, end), outs = tp_results[rank][(arch, t)]
            got = torch.from_numpy(shard)
            want = torch.full((hf_logits.shape[0], end - start), float("-inf"))
            real = hf_logits[:, start:min(end, TOKENIZER_VOCAB)]
            want[:, :real.shape[1]] = real
            assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"{arch} tp {t} rank {rank}: -inf pattern"
            fin = torch.isfinite(want)
            torch.testing.assert_close(got[fin], want[fin], atol=1e-4, rtol=0,
                                       msg=lambda m: f"{arch} tp {t} rank {rank}: {m}")
            if rank == 0:
                assert outs["greedy"] == hf_greedy, f"{arch} tp {t}: greedy tokens differ from transformers"
                guided[t] = outs["json"]
    assert all(g == guided[1] for g in guided.values()), f"{arch}: guided tokens differ across tp sizes: {guided}"
    assert len(guided[1]) > 3



def test_features_are_exercised(checkpoints):
    """The tiny configs really switch on what the families have (else the comparison proves less)."""
    from tpguide.model.config import ModelConfig

    refs, _ = checkpoints
    cfg = {a: ModelConfig.from_pretrained(r[0]) for a, r in refs.items()}
    for arch in ("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
                 "Gemma3ForCausalLM", "MixtralForCausalLM"):
        assert "sliding_attention" in cfg[arch].layer_types and cfg[arch].sliding_window == TINY_SLIDING_WINDOW
    assert cfg["Gemma2ForCausalLM"].attn_logit_softcapping and cfg["Gemma2ForCausalLM"].final_logit_softcapping
    assert cfg["Phi3ForCausalLM"].rope_params()["rope_type"] == "longrope"
    assert cfg["Phi3ForCausalLM"].rotary_dim() == 12
    g3 = cfg["Gemma3ForCausalLM"]
    assert g3.rope_params("sliding_attention")["rope_theta"] != g3.rope_params("full_attention")["rope_theta"]
    assert cfg["Qwen3ForCausalLM"].qk_norm and not cfg["Qwen3ForCausalLM"].tie_word_embeddings
    q_moe, mixtral = cfg["Qwen3MoeForCausalLM"], cfg["MixtralForCausalLM"]
    assert q_moe.qk_norm and q_moe.moe_layers == (0, 2) and not q_moe.norm_topk_prob  # layer 1 dense
    assert mixtral.moe_layers == (0, 1) and mixtral.norm_topk_prob and mixtral.router_weights_fp32
    assert q_moe.num_experts == mixtral.num_experts == 8 and q_moe.num_experts_per_tok == 2
    for c in cfg.values():
        assert c.padded_heads(3) == (6, 3) and c.padded_heads(4) == (8, 4)  # zero KV groups at tp 3 and 4
