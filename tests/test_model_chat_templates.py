"""Chat templates per family: template variables through ``chat_template_kwargs``, a template's own refusal.

The tiny checkpoint gets family-style templates: one that reads Qwen3's
``enable_thinking`` variable (as Qwen3's template does: an empty
``<think>`` block when thinking is off) and one that refuses a system
message the way Gemma's template does (``raise_exception``).  A refusal
fails that request only, with the template's reason; the others finish.
"""

import shutil

import pytest

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, generate_on_group
from tpguide.engine.request_io import parse_request

QWEN3_STYLE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
GEMMA_STYLE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CONFIG = EngineConfig(max_num_seqs=2, max_model_len=128)


def _with_template(src, dst, template):
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").write_text(template)
    return str(dst)


def test_chat_template_kwargs_reach_the_template(tiny_model_path, tmp_path):
    d = _with_template(tiny_model_path, tmp_path / "qwen3-style", QWEN3_STYLE)
    chat = [{"role": "user", "content": "hi"}]
    outs = generate_on_group(TPGroup(), d, [
        {"id": "plain", "messages": chat, "max_tokens": 2},
        {"id": "off", "messages": chat, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}},
    ], CONFIG)
    plain, off = (o["num_prompt_tokens"] for o in outs)
    assert all(o["error"] is None for o in outs)
    assert off > plain  # the empty think block was rendered


def test_template_refusing_the_system_role_fails_that_request_only(tiny_model_path, tmp_path):
    d = _with_template(tiny_model_path, tmp_path / "gemma-style", GEMMA_STYLE)
    outs = generate_on_group(TPGroup(), d, [
        {"id": "system", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
         "max_tokens": 2},
        {"id": "user", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ], CONFIG)
    by_id = {o["id"]: o for o in outs}
    assert by_id["system"]["finish_reason"] == "error"
    assert "chat template rejected the messages: System role not supported" in by_id["system"]["error"]
    assert by_id["user"]["error"] is None and len(by_id["user"]["token_ids"]) == 2


def test_chat_template_kwargs_validation():
    with pytest.raises(ValueError, match="'chat_template_kwargs' needs 'messages'"):
        parse_request({"prompt": "x", "chat_template_kwargs": {"enable_thinking": False}}, 0, 4)
    with pytest.raises(ValueError, match="must be an object with string keys"):
        parse_request({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]}, 0, 4)
