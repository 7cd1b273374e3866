"""Test support for tool-call formats: compact chat templates of each family's form, tiny models that carry them.

The templates render ``tools`` the way each family's own template does (the
real ones are not available offline): Llama 3.1 puts the tools as JSON in
the first user turn, Mistral v0.3 as ``[AVAILABLE_TOOLS]`` before the last
``[INST]``, Qwen 2.5 / 3 as ``<tools>`` XML in the system turn, Phi-4-mini
between ``<|tool|>`` tags.  Gemma 2's refuses a system message and knows no
tools.  Each model is a tiny random-weight checkpoint of the family with
SmolLM2's tokenizer (``tpguide.model.random_checkpoint``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tpguide.model.random_checkpoint import tiny_hf_config, write_random_model

LLAMA31 = (
    "{% set first = namespace(done=false) %}"
    "{% for m in messages %}"
    "<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if m.role == 'user' and tools is defined and tools and not first.done %}"
    "{% set first.done = true %}"
    "Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\n\nRespond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\n\n'
    "{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}"
    "{% endif %}"
    "{% if m.tool_calls is defined and m.tool_calls %}"
    "{% for tc in m.tool_calls %}"
    '{{ "; " if not loop.first }}{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}'
    "{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL = (
    "{% for m in messages %}"
    "{% if m.role == 'user' or m.role == 'system' %}"
    "{% if tools is defined and tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST] {{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls is defined and m.tool_calls %}"
    "[TOOL_CALLS] [{% for tc in m.tool_calls %}{{ ', ' if not loop.first }}"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}{% endfor %}]</s>'
    "{% elif m.role == 'assistant' %}{{ m.content }}</s>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS] {{ m.content }}[/TOOL_RESULTS]"
    "{% endif %}{% endfor %}"
)
QWEN = (
    "{% if tools is defined and tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and tools is defined and tools %}"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.tool_calls is defined and m.tool_calls %}<|im_start|>assistant\n"
    "{% for tc in m.tool_calls %}{{ '\n' if not loop.first }}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_CODER = QWEN.replace(
    '{"name": <function-name>, "arguments": <args-json-object>}',
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>",
).replace(
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}',
    "<function={{ tc.function.name }}>{{ '\\n' }}{% for k, v in tc.function.arguments.items() %}<parameter={{ k }}>"
    "{{ '\\n' }}{{ v }}{{ '\\n' }}</parameter>{{ '\\n' }}{% endfor %}</function>",
)
PHI4_MINI = (
    "{% for m in messages %}"
    "{% if loop.first and tools is defined and tools %}<|system|>You can call tools with functools[...]"
    "<|tool|>{{ tools | tojson }}<|/tool|><|end|>{% endif %}"
    "<|{{ m.role }}|>{{ m.content }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
GEMMA2 = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

#: A tool as a Jinja dict literal, as many real templates list tools (it holds ``"parameters"`` whatever the format).
TOOL_DICT = ('{"type": "function", "function": {"name": t.function.name, '
             '"description": t.function.description | default(""), "parameters": t.function.parameters}}')
_HERMES_CALL = '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}'
QWEN_DICT = QWEN.replace("{{ t | tojson }}", "{{ " + TOOL_DICT + " | tojson }}").replace(
    _HERMES_CALL, '{{ {"name": tc.function.name, "arguments": tc.function.arguments} | tojson }}')
LLAMA31_DICT = LLAMA31.replace("{{ t | tojson(indent=4) }}", "{{ " + TOOL_DICT + " | tojson(indent=4) }}").replace(
    '{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}',
    '{{ {"name": tc.function.name, "parameters": tc.function.arguments} | tojson }}')
# Mistral v3's own way: the call object without its last brace, then the 9-character id
MISTRAL_DICT = MISTRAL.replace(
    "{{ tools | tojson }}", "[{% for t in tools %}{{ ', ' if not loop.first }}{{ " + TOOL_DICT + " | tojson }}"
    "{% endfor %}]").replace(
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}',
    '{% set out = {"name": tc.function.name, "arguments": tc.function.arguments} | tojson %}'
    '{{ out[:-1] }}, "id": "{{ tc.id }}"}')
QWEN_CODER_DICT = QWEN_CODER.replace("{{ t | tojson }}", "{{ " + TOOL_DICT + " | tojson }}")
PHI4_MINI_DICT = PHI4_MINI.replace(
    "{{ tools | tojson }}", "[{% for t in tools %}{{ ', ' if not loop.first }}{{ " + TOOL_DICT + " | tojson }}"
    "{% endfor %}]")
#: format -> its family's templates: tools through a ``tojson`` filter, and as a Jinja dict literal.
STYLES = {"hermes": (QWEN, QWEN_DICT), "qwen3": (QWEN, QWEN_DICT), "llama3_json": (LLAMA31, LLAMA31_DICT),
          "mistral": (MISTRAL, MISTRAL_DICT), "phi4_mini_json": (PHI4_MINI, PHI4_MINI_DICT),
          "qwen3_coder": (QWEN_CODER, QWEN_CODER_DICT)}
#: format -> (token, special) its family's tokenizer adds: control tokens are special in ``added_tokens_decoder``
#: (not in ``additional_special_tokens``); Qwen 2.5 / 3 add ``<tool_call>`` as a plain added token.
FAMILY_TOKENS = {
    "mistral": [(t, True) for t in ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]")],
    "llama3_json": [(t, True) for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>")],
    "phi4_mini_json": [(t, True) for t in ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>",
                                           "<|/tool|>")],
    "hermes": [("<tool_call>", False), ("</tool_call>", False)],
}
FAMILY_TOKENS["qwen3"] = FAMILY_TOKENS["qwen3_coder"] = FAMILY_TOKENS["hermes"]


def family_tokenizer(tokenizer, fmt_name: str, template: str):
    """A copy of ``tokenizer`` with the family's added tokens (:data:`FAMILY_TOKENS`) and ``template``."""
    import copy

    from transformers import AddedToken

    tok = copy.deepcopy(tokenizer)
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in FAMILY_TOKENS[fmt_name]])
    tok.chat_template = template
    return tok


#: format -> (architecture, chat template, a string the template writes when it shows the tools).
FAMILIES = {
    "hermes": ("Qwen2ForCausalLM", QWEN, "<tools>\n{\"type\": \"function\""),
    "qwen3": ("Qwen3ForCausalLM", QWEN, "<tools>\n{\"type\": \"function\""),
    "llama3_json": ("LlamaForCausalLM", LLAMA31, "Given the following functions"),
    "mistral": ("MistralForCausalLM", MISTRAL, "[AVAILABLE_TOOLS] [{\"type\": \"function\""),
    "phi4_mini_json": ("Phi3ForCausalLM", PHI4_MINI, "<|tool|>[{\"type\": \"function\""),
    "qwen3_coder": ("Qwen3ForCausalLM", QWEN_CODER, "<tools>\n{\"type\": \"function\""),
}
VOCAB = 49152  # SmolLM2's tokenizer
MAX_MODEL_LEN = 1024  # a prompt with tools takes a few hundred tokens


def write_family_model(out_dir, architecture: str, template: str, tokenizer_dir, seed: int = 0,
                       vocab_size: int = VOCAB) -> str:
    """A tiny random ``architecture`` checkpoint with the tokenizer of ``tokenizer_dir`` and ``template``."""
    out = Path(out_dir)
    config = tiny_hf_config(architecture, vocab_size, tokenizer_dir, max_position_embeddings=MAX_MODEL_LEN)
    write_random_model(out, config, seed=seed,
                       tokenizer_dir=tokenizer_dir)
    (out / "chat_template.jinja").write_text(template)
    return str(out)


def with_template(src, dst, template: str) -> str:
    """A copy of the checkpoint directory ``src`` with another chat template."""
    shutil.copytree(src, dst)
    (Path(dst) / "chat_template.jinja").write_text(template)
    return str(dst)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["zone"],
    "additionalProperties": False}}}
#: (id, tool_choice, parallel_tool_calls, backend) of the request lines of :func:`tool_lines`.
CASES = (("required", "required", False, "xgrammar"),
         ("named", {"type": "function", "function": {"name": "get_time"}}, None, "xgrammar"),
         ("auto", "auto", False, "xgrammar"),
         ("required-ll", "required", False, "llguidance"))


def family_setup(model_dir: str, fmt_name: str):
    """``--tool-call-parser auto`` on the family model in ``model_dir`` (compact JSON whitespace)."""
    from transformers import AutoTokenizer

    from tpguide.serving.tool_formats import choose_tool_format

    arch = FAMILIES[fmt_name][0]
    setup = choose_tool_format("auto", arch, AutoTokenizer.from_pretrained(model_dir), json_whitespace="compact")
    assert setup.fmt.name == fmt_name and setup.template_tools, setup
    return setup


def tool_lines(setup, prefix: str, max_tokens: int = 96):
    """Request lines of :data:`CASES` as the server maps them (one chat body each), and their tool plans by id."""
    from tpguide.serving.protocol import parse_request

    lines, plans = [], {}
    for case, choice, parallel, backend in CASES:
        if backend == "llguidance" and not setup.fmt.json_arguments:
            continue  # an XML format's guide is xgrammar's only
        body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris for 3 days?"}],
                "tools": [WEATHER, TIME], "tool_choice": choice, "temperature": 0, "max_tokens": max_tokens,
                "logprobs": True, **({"parallel_tool_calls": parallel} if parallel is not None else {})}
        parsed = parse_request(body, "chat", f"{prefix}-{case}", backend=backend, tool_format=setup)
        (line,) = parsed.lines
        lines.append(line)
        plans[line["id"]] = parsed.tools
    return lines, plans


def run_formats(group, jobs, config):
    """Module-level (spawnable): ``jobs`` [(model dir, request lines)] one engine after another; (outputs, stats) each."""
    from grammar_draft_testing import run

    return [run(group, model_dir, lines, config) for model_dir, lines in jobs]


def write_control_model(out_dir, tokenizer_dir, seed: int = 7) -> str:
    """A tiny random Mistral checkpoint whose tokenizer has Mistral's control tokens (``[TOOL_CALLS]`` ...).

    The tokens are added as Mistral's tokenizer has them: special in
    ``added_tokens_decoder``, not among ``additional_special_tokens``.
    """
    from transformers import AutoTokenizer

    tok = family_tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir), "mistral", MISTRAL)
    tok_dir = Path(out_dir) / "tokenizer"
    tok.save_pretrained(tok_dir)
    for extra in ("generation_config.json",):
        if (Path(tokenizer_dir) / extra).exists():
            shutil.copy(Path(tokenizer_dir) / extra, tok_dir / extra)
    return write_family_model(Path(out_dir) / "model", "MistralForCausalLM", MISTRAL, tok_dir, seed=seed,
                              vocab_size=len(tok))


def control_lines(model_dir: str, backend_cases=(("xgrammar", "required"), ("xgrammar", "named"),
                                                 ("xgrammar", "auto"), ("llguidance", "required"))):
    """(setup, [(case, ParsedRequest)]) on the control-token model: ``auto`` gets a bias toward ``[TOOL_CALLS]``.

    Greedy, parallel calls allowed on xgrammar (llguidance: one call); xgrammar's ``required`` gets a bias toward ``,`` (the list separator)
    so that it writes more than one call; ``auto``'s bias makes ``[TOOL_CALLS]`` the greedy first token.
    """
    from transformers import AutoTokenizer

    from tpguide.serving.protocol import parse_request
    from tpguide.serving.tool_formats import choose_tool_format

    tok = AutoTokenizer.from_pretrained(model_dir)
    setup = choose_tool_format("auto", "MistralForCausalLM", tok, json_whitespace="compact")
    tid = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    comma = tok.encode(",", add_special_tokens=False)[0]
    choices = {"required": "required", "named": {"type": "function", "function": {"name": "get_time"}}, "auto": "auto"}
    out = []
    for backend, case in backend_cases:
        bias = {"auto": {str(tid): 60.0}, "required": {str(comma): 8.0} if backend == "xgrammar" else {}}.get(case, {})
        body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris for 3 days?"}],
                "tools": [WEATHER, TIME], "tool_choice": choices[case], "temperature": 0, "max_tokens": 120,
                "logit_bias": bias, "parallel_tool_calls": backend == "xgrammar", "logprobs": True}
        out.append((f"{case}-{backend}", parse_request(body, "chat", f"ctl-{case}-{backend}", backend=backend,
                                                      tool_format=setup)))
    return setup, out
