"""How often the embedded model starts a second tool call in ``tool_choice: "required"`` (docs/tool-calls.md).

Each prompt asks for one thing that one call answers.  With
``parallel_tool_calls`` left on, the guide allows more calls after the
first, so the model may start a second one; at a small ``max_tokens`` it is
then cut (``finish_reason: "length"``).  The script runs the prompts
through the server's request mapping and answer building (tp 1, greedy),
with ``parallel_tool_calls`` on and off, and prints per setting: answers
with a second call started, answers cut by the limit, answers whose
``content`` holds anything (it must be none).

    python benchmarks/bench_second_call.py --max-tokens 48
"""

from __future__ import annotations

import argparse
from collections import Counter

CITIES = ("Paris", "Oslo", "Rome", "Lima", "Cairo", "Tokyo", "Quito", "Dakar")
ASKS = ("What is the weather in {c}?", "Will it rain in {c} tomorrow?", "How warm is it in {c} today?")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    from tpguide.dist import TPGroup
    from tpguide.engine import EngineConfig, generate_on_group
    from tpguide.engine.request import RequestOutput
    from tpguide.model.default_model import default_model_dir
    from tpguide.serving.protocol import parse_request
    from tpguide.serving.responses import TokenText, build_answer
    from tpguide.serving.tool_formats import choose_tool_format

    torch.set_num_threads(args.threads)
    model = str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(model)
    setup = choose_tool_format("auto", "LlamaForCausalLM", tok)
    prompts = [a.format(c=c) for c in CITIES for a in ASKS]
    for parallel in (True, False):
        parsed, lines = [], []
        for i, prompt in enumerate(prompts):
            body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "tools": [WEATHER, TIME],
                    "tool_choice": "required", "parallel_tool_calls": parallel, "temperature": 0,
                    "max_tokens": args.max_tokens}
            p = parse_request(body, "chat", f"p{int(parallel)}-{i}", tool_format=setup)
            parsed.append(p)
            lines.append(p.lines[0])
        config = EngineConfig(max_num_seqs=8, max_model_len=2048)
        outputs = {o["id"]: o for o in generate_on_group(TPGroup(), model, lines, config)}
        counts = Counter()
        for p in parsed:
            o = outputs[p.lines[0]["id"]]
            scan = setup.fmt.scan(o["text"], True)
            first_done = bool(scan.calls) and scan.calls[0].complete  # then EOS, or more: the next call
            counts["second call started"] += first_done and (len(scan.calls) >= 2 or o["finish_reason"] == "length")
            counts["cut (length)"] += o["finish_reason"] == "length"
            out = RequestOutput(o["id"], token_ids=o["token_ids"], text=o["text"], finish_reason=o["finish_reason"])
            message = build_answer(p, "r", [out], TokenText(tok))["choices"][0]["message"]
            counts["content not empty"] += message["content"] is not None
            counts["a complete call"] += bool(message.get("tool_calls"))
        print(f"parallel_tool_calls={parallel}, max_tokens={args.max_tokens}, {len(prompts)} prompts: "
              + ", ".join(f"{k}: {counts[k]}" for k in ("second call started", "cut (length)", "a complete call",
                                                          "content not empty")))


if __name__ == "__main__":
    main()
