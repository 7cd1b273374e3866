"""Model side: config, tensor-parallel layers, architectures, weight loading.

Families (one file each where they differ): ``llama`` (also Mistral, Qwen2),
``qwen3``, ``phi3``, ``gemma2``, ``gemma3``, and the mixtures of experts
``qwen3_moe`` and ``mixtral``; shared blocks in ``norm``,
``rotary``, ``attention``, ``parallel_linear``, ``vocab_parallel_embedding``,
``moe`` (with ``moe_router``, ``moe_checkpoint``);
``hf_config`` translates transformers configs; ``safetensors_reader`` reads
each rank's slices; ``model_source`` resolves ``--model`` (HF directory,
``FILE.gguf``, or the embedded default).

Nothing is imported here, so ``tpguide.model.vocab_shard`` (pure index
arithmetic) stays free of ``torch.distributed``.  Import from the modules::

    from tpguide.model.loader import load_model
    from tpguide.model.model_source import resolve_model_dir
    from tpguide.model.safetensors_reader import checkpoint_dtype
    from tpguide.model.attention import AttentionMetadata
    from tpguide.model.default_model import default_model_dir
    from tpguide.model.random_checkpoint import write_random_checkpoint

What the engine calls::

    model_dir = resolve_model_dir(args.model, group)                    # HF dir / FILE.gguf / default
    checkpoint_dtype(model_dir)                                          # e.g. torch.bfloat16 (for --dtype auto)
    model = load_model(model_dir, group, dtype, tokenizer_vocab_size)   # this rank's shard
    model.allocate_kv_cache(num_blocks, block_size, max_model_len)     # the paged pool
    meta = AttentionMetadata.from_block_tables(block_tables, query_lens, context_lens, device)
    hidden = model(input_ids, meta.token_positions, meta)               # [T, hidden], replicated
    logits = model.compute_logits(hidden[selected_token_indices])       # fp32 [R, padded_vocab_size // tp_size]
    model.vocab_shard                                                    # VocabShard of this rank
"""
