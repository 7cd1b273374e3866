"""Each tool-call format on a tiny random model of its family (tp 1): the template shows the tools, calls come back.

Per format, a random-weight checkpoint of the family with a chat template of
the family's form (``tests/tool_format_testing.py``), ``--tool-call-parser
auto``: the prompt holds the tools as the template renders them (not
tpguide's own tool prompt); ``tool_choice`` required and named (xgrammar)
and required (llguidance) finish with calls written in the format that parse
into ``tool_calls`` whose arguments validate; ``auto`` finishes without a
broken call.  Token identity at tp 2 and with grammar drafts:
``tests/multigpu/test_tool_formats_tp.py``.
"""

from __future__ import annotations

import pytest
from tool_format_testing import FAMILIES, family_setup, tool_lines, write_family_model

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, generate_on_group
from tpguide.engine.intake import tokenize_prompt
from tpguide.engine.request_io import parse_request
from tpguide.serving.responses import chat_message
from tpguide.serving.tool_calls import tool_call_error

CONFIG = EngineConfig(max_num_seqs=4, max_model_len=1024, guided_backend="auto")


@pytest.mark.parametrize("fmt_name", sorted(FAMILIES))
def test_format_on_its_family(fmt_name, tmp_path, default_model_path):
    arch, template, shown = FAMILIES[fmt_name]
    model = write_family_model(tmp_path / fmt_name, arch, template, default_model_path, seed=3)
    setup = family_setup(model, fmt_name)
    fmt = setup.fmt
    lines, plans = tool_lines(setup, fmt_name)
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(model).decode(
        tokenize_prompt(AutoTokenizer.from_pretrained(model), parse_request(lines[0], 0, 8)))
    assert shown in prompt and '"name": "get_time"' in prompt and "# Tools\n\nYou can call" not in prompt

    outputs = {o["id"]: o for o in generate_on_group(TPGroup(), model, lines, CONFIG)}
    for case in ("required", "named", "required-ll"):
        if f"{fmt_name}-{case}-0" not in outputs:  # no llguidance line for an XML format
            assert case.endswith("-ll") and not fmt.json_arguments
            continue
        out = outputs[f"{fmt_name}-{case}-0"]
        assert out["finish_reason"] == "stop", (case, out["error"], out["text"])
        assert out["guided_backend"] == ("llguidance" if case.endswith("-ll") else "xgrammar")
        assert out["text"].startswith(fmt.block_open or fmt.call_prefix("get_")[:len(fmt.call_open) + 9]), out["text"]
        plan = plans[out["id"]]
        assert tool_call_error(out["text"], plan) is None
        message, reason = chat_message(out["text"], plan, "stop")
        assert reason == "tool_calls" and message["content"] is None and len(message["tool_calls"]) == 1
        assert message["tool_calls"][0]["function"]["name"] in ({"get_time"} if case == "named"
                                                                 else {"get_time", "get_weather"})
    auto = outputs[f"{fmt_name}-auto-0"]
    assert auto["finish_reason"] in ("stop", "length"), auto["error"]
    if auto["finish_reason"] == "stop":
        assert tool_call_error(auto["text"], plans[auto["id"]]) is None
