"""The peer of the speed benchmarks: transformers ``generate`` with ``xgrammar.contrib.hf.LogitsProcessor``."""

from __future__ import annotations

import time
from typing import List, Sequence, Tuple

import torch


class HFRunner:
    """One transformers model (on ``device``, at ``dtype``), greedy ``generate`` under xgrammar grammars.

    Grammars are compiled with the same tokenizer info tpguide's xgrammar
    backend builds (:func:`tpguide.guided.xgrammar_backend.make_tokenizer_info`:
    the model's padded vocabulary, every stop token of the model and its chat template).
    """

    def __init__(self, model_dir: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        import xgrammar as xgr
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tpguide.guided.xgrammar_backend import make_tokenizer_info
        from tpguide.model.tokenizer_facts import collect_stop_token_ids

        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        self.stop_ids = collect_stop_token_ids(self.tokenizer, model_dir)
        info = make_tokenizer_info(self.tokenizer, self.model.config.vocab_size, self.stop_ids)
        self.compiler = xgr.GrammarCompiler(info)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]

    def compile_json(self, schema_text: str, json_whitespace: str = "bounded"):
        """``schema_text`` compiled as tpguide's xgrammar backend compiles it (``json_whitespace`` mode)."""
        from tpguide.guided.params import xgrammar_json_options

        return self.compiler.compile_json_schema(schema_text, **xgrammar_json_options(json_whitespace))

    def generate(self, messages: Sequence[list], grammars: Sequence, max_tokens: int) -> Tuple[List[List[int]], float]:
        """Greedy chat completions of ``messages`` (one row each) under ``grammars`` (one compiled grammar per row).

        Returns each row's new token ids up to and including its first stop
        token, and the wall seconds of ``generate`` (on CUDA up to a synchronize).
        Raises ``ValueError`` if the two lists differ in length.
        """
        import xgrammar as xgr

        if len(messages) != len(grammars):
            raise ValueError(f"{len(messages)} message rows but {len(grammars)} grammars")
        texts = [self.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
        batch = self.tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True).to(self.device)
        processor = xgr.contrib.hf.LogitsProcessor(list(grammars))  # one per generate() call
        start = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(**batch, max_new_tokens=max_tokens, do_sample=False,
                                      logits_processor=[processor], eos_token_id=self.stop_ids,
                                      pad_token_id=self.pad_id, temperature=None, top_p=None, top_k=None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - start
        tokens = []
        for row in out[:, batch["input_ids"].shape[1]:].tolist():
            ends = [j for j, t in enumerate(row) if t in self.stop_ids]
            tokens.append(row[: ends[0] + 1] if ends else row)
        return tokens, wall
