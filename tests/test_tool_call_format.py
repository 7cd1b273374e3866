"""Both tool-call syntaxes satisfy the ``CallFormat`` protocol, by members and by method signatures."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from tpguide.serving.tool_formats import FORMATS, CallFormat, JsonCallFormat, Scan
from tpguide.serving.tool_formats.xml_calls import XmlCallFormat

_METHODS = [n for n, v in vars(CallFormat).items() if inspect.isfunction(v) and not n.startswith("_")]
_PROPERTIES = [n for n, v in vars(CallFormat).items() if isinstance(v, property)]


def test_the_protocol_lists_what_the_parsers_use():
    assert sorted(_METHODS) == ["call_pattern", "call_prefix", "new_call_id", "render_call", "render_calls", "scan"]
    assert "call_suffix" in _PROPERTIES and "json_arguments" in _PROPERTIES and len(_PROPERTIES) == 13


@pytest.mark.parametrize("cls", [JsonCallFormat, XmlCallFormat])
def test_each_format_class_has_the_protocol_signatures(cls):
    for name in _METHODS:
        want, got = inspect.signature(getattr(CallFormat, name)), inspect.signature(getattr(cls, name))
        assert list(got.parameters) == list(want.parameters), (cls.__name__, name, got, want)
        assert [p.default for p in got.parameters.values()] == [p.default for p in want.parameters.values()], name
    fields = {f.name for f in dataclasses.fields(cls)}
    for name in _PROPERTIES:
        assert name in fields or name in vars(cls), (cls.__name__, name)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_table_format_is_a_call_format(name):
    fmt = FORMATS[name]
    assert isinstance(fmt, CallFormat)
    text = "Hi " + fmt.render_calls([("get_weather", '{"city": "Paris"}')])
    scan = fmt.scan(text, final=True)
    assert isinstance(scan, Scan) and scan.finished() == ("Hi", [("get_weather", '{"city": "Paris"}')])


def test_an_object_without_a_scanner_is_not_a_call_format():
    @dataclasses.dataclass(frozen=True)
    class NoScan:
        name: str = "x"

    assert not isinstance(NoScan(), CallFormat)
