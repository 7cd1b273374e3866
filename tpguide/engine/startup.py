"""Start-up of one replica: this rank's model shard and, on the driver, the tokenizer, stop ids and reasoning parser.

docs/architecture.md §1.  :func:`build_engine` is what ``launch/generate.py``,
``launch/serve.py`` and the multi-rank tests call on every rank of a TP group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.engine.config import EngineConfig
from tpguide.engine.engine import Engine
from tpguide.model.config import ModelConfig
from tpguide.model.tokenizer_facts import producible_vocab_size

__all__ = ["build_engine"]


def build_engine(group: TPGroup, model_dir: Optional[str], config: EngineConfig) -> Engine:
    """Build this rank's :class:`Engine`: its model shard (and draft head), on the driver also the tokenizer,
    stop ids and reasoning parser.

    ``model_dir=None`` selects the embedded default model, a path ending in
    ``.gguf`` that GGUF file (each converted once to safetensors by the driver
    while the other ranks wait).

    Raises
    ------
    ValueError
        Missing model directory, unusable tp size, checkpoint/config mismatch.
    """
    from tpguide.guided.reasoning import resolve_reasoning_parser
    from tpguide.model.loader import load_model
    from tpguide.model.model_source import resolve_model_dir

    model_dir = str(resolve_model_dir(model_dir, group))  # HF directory, FILE.gguf (converted once) or default
    # every rank checks the directory and tp size before the first collective,
    # so each one fails with the same clear message
    if not Path(model_dir).is_dir():
        raise ValueError(f"model directory {model_dir!r} does not exist")
    ModelConfig.from_pretrained(model_dir).check_tp_size(group.tp_size)
    tokenizer = stop_ids = error = reasoning = None
    if group.is_driver:
        try:
            from transformers import AutoTokenizer

            from tpguide.model.tokenizer_facts import collect_stop_token_ids

            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            stop_ids = collect_stop_token_ids(tokenizer, model_dir)
        except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised
            error = f"cannot load the tokenizer from {model_dir!r}: {type(exc).__name__}: {exc}"
        if error is None:
            try:
                reasoning = resolve_reasoning_parser(config.reasoning_parser, tokenizer)
            except ValueError as exc:
                error = str(exc)
    tokenizer_vocab_size, all_stop_ids, error = C.broadcast_object(
        (producible_vocab_size(tokenizer) if tokenizer is not None else None, stop_ids, error), group)
    if error is not None:
        raise ValueError(error if group.is_driver else f"the driver (rank 0) failed to start: {error}")
    model = load_model(model_dir, group, config.dtype, tokenizer_vocab_size=tokenizer_vocab_size,
                       tp_invariant=config.tp_invariant)
    draft_head = None
    if config.speculative_method == "draft-head":
        from tpguide.speculative.draft_head import build_draft_head

        num_hidden = model.config.num_hidden_layers
        num_layers = config.draft_num_layers or -(-num_hidden // 3)
        if num_layers > num_hidden:
            raise ValueError(f"draft_num_layers={num_layers} exceeds the model's {num_hidden} layers")
        draft_head = build_draft_head(model, model_dir, num_layers, config.draft_vocab_size, all_stop_ids,
                                      lens=config.draft_lens, tokenizer=tokenizer)
    engine = Engine(model, group, config, tokenizer=tokenizer, stop_token_ids=stop_ids, draft_head=draft_head,
                    reasoning=reasoning)
    if engine.driver is not None:  # the receipts' model fingerprint and engine facts, once (docs/receipts.md)
        from tpguide.engine.model_fingerprint import model_fingerprint
        from tpguide.engine.receipt import ReceiptContext, engine_section

        engine.driver.receipts = ReceiptContext(
            model=model_fingerprint(model_dir, getattr(tokenizer, "chat_template", None)),
            engine=engine_section(config, group.tp_size, group.device, getattr(group, "dp_size", 1)))
    return engine
