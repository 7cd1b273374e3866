"""One request's admission, followed from ``Intake.add``: ``guided/admission.py`` is entered at most twice.

Under ``--guided-backend auto`` the backends are tried in order by one
function (``admit``, docs/architecture.md §5); no backend calls back into
admission (before issue 50, ``admit`` handed ``auto`` to
``AutoBackend.compile``, which called ``admit`` again for each backend).
Traced with ``sys.settrace`` and ``threading.settrace`` (the admission runs
in the compile worker's thread): a call counts as an entry when its frame's
file is ``admission.py`` and its caller's is another file.  Three guides,
each new to the backend's cache: one xgrammar admits, one only llguidance
enforces, one neither can guarantee.
"""

from __future__ import annotations

import sys
import threading
import uuid
from pathlib import Path

import pytest

from tpguide.engine.config import EngineConfig
from tpguide.engine.intake import Intake
from tpguide.engine.kv_cache_manager import KVCacheManager
from tpguide.engine.request_io import request_from_dict

GUIDED = Path(__file__).resolve().parents[1] / "tpguide" / "guided"
ADMISSION, AUTO_BACKEND = str(GUIDED / "admission.py"), str(GUIDED / "auto_backend.py")
CONFIG = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
#: (schema, the backend that admits it under auto, or None: refused by both)
CASES = {
    "xgrammar": ({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}, "xgrammar"),
    # xgrammar does not enforce multipleOf on a number (guided/enforcement.py): auto goes on to llguidance
    "llguidance": ({"type": "number", "multipleOf": 0.5}, "llguidance"),
    # xgrammar does not enforce uniqueItems, llguidance does not compile it
    "refused": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, None),
}


@pytest.fixture(scope="module")
def auto_backend(tokenizer):
    from guided_testing import load_test_backend

    return load_test_backend("auto", 49152)


def traced_admission(tokenizer, backend, schema):
    """Admit one request through ``Intake.add`` under the tracer: ``(request, entries into admission.py)``.

    Each entry is ``(caller's file, caller's function, admission.py's function)``.
    """
    entries, tracing = [], [True]

    def tracer(frame, event, arg):
        caller = frame.f_back
        if (tracing[0] and event == "call" and frame.f_code.co_filename == ADMISSION and caller is not None
                and caller.f_code.co_filename != ADMISSION):
            entries.append((Path(caller.f_code.co_filename).name, caller.f_code.co_name, frame.f_code.co_name))
        return None  # calls only, no line events

    threading.settrace(tracer)  # the compile worker starts with the Intake
    sys.settrace(tracer)
    try:
        intake = Intake(tokenizer, CONFIG, KVCacheManager(16, CONFIG.block_size, False))
        req = request_from_dict({"prompt": "A value:", "max_tokens": 8,  # a guide new to the backend's cache
                                 "structured_output": {"json": {"description": str(uuid.uuid4()), **schema}}}, 0, 8)
        intake.add(req, backend=backend)
        while intake.has_arrivals():
            intake.wait()
            intake.take_admitted()
    finally:
        sys.settrace(None)
        threading.settrace(None)
        tracing[0] = False  # the daemon worker keeps its tracer: it records nothing more
    return req, entries


@pytest.mark.parametrize("case", CASES)
def test_admission_is_entered_at_most_twice_and_never_from_a_backend(tokenizer, auto_backend, case):
    schema, admitted_by = CASES[case]
    req, entries = traced_admission(tokenizer, auto_backend, schema)
    if admitted_by is None:
        assert req.finish_reason == "error" and req.error.startswith("no guided backend can guarantee"), req.error
        assert "xgrammar: schema refused: 'uniqueItems' is not enforced by xgrammar" in req.error
        assert "llguidance:" in req.error
    else:
        assert not req.is_finished and req.guided_backend == admitted_by, (req.error, req.guided_backend)
        assert req.compiled_guide.backend_name == admitted_by  # what the decoder makes the request's matcher from
        assert req.compiled_guide is auto_backend.compile(req.structured_output)  # auto's cache holds the admission
    assert 1 <= len(entries) <= 2, entries
    assert [e for e in entries if e[0] == Path(AUTO_BACKEND).name] == [], entries
    assert entries[0][0] == "intake.py", entries


def test_auto_compiles_only_through_admission(auto_backend):
    from tpguide.guided.admission import admit
    from tpguide.guided.params import StructuredOutputsParams

    params = StructuredOutputsParams(json={"description": str(uuid.uuid4()), "type": "boolean"})
    with pytest.raises(ValueError, match="not admitted under auto"):
        auto_backend.compile(params)
    name, admitted = admit(auto_backend, params)
    assert (name, admitted.backend_name) == ("xgrammar", "xgrammar") and auto_backend.compile(params) is admitted
    assert admit(auto_backend, params) == (name, admitted)  # the second admission: a lookup
