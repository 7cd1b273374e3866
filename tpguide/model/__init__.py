"""Model side: config, tensor-parallel layers, architectures, weight loading.

Nothing is imported here, so ``tpguide.model.vocab_shard`` (pure index
arithmetic) stays free of ``torch.distributed``.  Import from the modules::

    from tpguide.model.loader import load_model
    from tpguide.model.attention import AttentionMetadata
    from tpguide.model.default_model import default_model_dir
    from tpguide.model.random_checkpoint import write_random_checkpoint

What the engine calls::

    model = load_model(model_dir, group, dtype, tokenizer_vocab_size)   # this rank's shard
    model.allocate_kv_cache(num_slots, max_model_len)
    meta = AttentionMetadata.from_lists(seq_slots, query_lens, context_lens, device)
    hidden = model(input_ids, meta.token_positions, meta)               # [T, hidden], replicated
    logits = model.compute_logits(hidden[selected_token_indices])       # fp32 [R, padded_vocab_size // tp_size]
    model.vocab_shard                                                    # VocabShard of this rank
"""
