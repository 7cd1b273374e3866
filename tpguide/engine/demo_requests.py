"""The built-in demo of ``launch/generate.py``: one chat request per guide type, plus an unguided and a sampled one."""

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}

ARITHMETIC_EBNF = r"""
root ::= expr " = " number
expr ::= number (" " op " " number)*
op ::= "+" | "-" | "*"
number ::= [1-9] [0-9]{0,2}
"""


def _chat(text):
    return [{"role": "user", "content": text}]


DEMO_REQUESTS = [
    {"id": "json-schema", "messages": _chat(
        "Invent a fictional person. Reply with JSON with the keys name, age and city."),
     "structured_output": {"json": PERSON_SCHEMA}},
    {"id": "json-object", "messages": _chat(
        "Reply with a JSON object with two keys, France and Italy, mapping each to its capital."),
     "structured_output": {"json_object": True}},
    {"id": "regex-date", "messages": _chat(
        "On which date did the first human land on the Moon? Answer as YYYY-MM-DD."),
     "structured_output": {"regex": r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"}},
    {"id": "choice", "messages": _chat(
        "Is the sentiment of this review positive or negative? 'I loved every minute of it.'"),
     "structured_output": {"choice": ["positive", "negative"]}},
    {"id": "grammar-ebnf", "messages": _chat("Write a small sum of two numbers and its result."),
     "structured_output": {"grammar": ARITHMETIC_EBNF}},
    {"id": "unguided", "messages": _chat("Write one short sentence about the sea."),
     "structured_output": None},
    {"id": "json-schema-sampled", "messages": _chat(
        "Invent another fictional person, as JSON with name, age and city."),
     "structured_output": {"json": PERSON_SCHEMA}, "temperature": 0.8, "seed": 7},
]
