"""Penalties and logit_bias: sharded application == a dense oracle, bit for bit; stop strings."""

from __future__ import annotations

import pytest
import torch

from tpguide.engine.request import SamplingParams
from tpguide.engine.stop_strings import find_stop_string
from tpguide.sampling.penalties import apply_penalties_inplace, build_logit_penalties

V = 1001


def oracle(logits, rows):
    """Plain loops over the full vocabulary (OpenAI / CTRL definitions)."""
    out = logits.clone()
    for r, (sp, prompt, output) in enumerate(rows):
        for t in range(V):
            x = out[r, t]
            if sp.repetition_penalty != 1.0 and (t in prompt or t in output):
                x = x / sp.repetition_penalty if x > 0 else x * sp.repetition_penalty
            c = output.count(t)
            x = x - sp.frequency_penalty * c - sp.presence_penalty * (c > 0)
            x = x + dict(sp.logit_bias).get(t, 0.0)
            out[r, t] = x
    return out


ROWS = [
    (SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25,
                    logit_bias={"7": 5.0, "999": -100}), [1, 2, 3, 500], [3, 3, 600, 999, 7]),
    (SamplingParams(), [4, 5], [6]),
    (SamplingParams(frequency_penalty=-1.0, logit_bias={"0": 2.5}), [9], [1000, 1000, 250]),
    (SamplingParams(repetition_penalty=0.8), [10, 11, 760], [12, 760]),
]


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4])
def test_sharded_penalties_equal_the_dense_oracle(tp_size):
    torch.manual_seed(0)
    logits = torch.randn(len(ROWS), V) * 4
    logits[0, 5] = float("-inf")  # masked stays masked
    want = oracle(logits, ROWS)
    pen = build_logit_penalties(ROWS)
    bounds = [round(i * V / tp_size) for i in range(tp_size + 1)]
    shards = []
    for r in range(tp_size):
        shard = logits[:, bounds[r]:bounds[r + 1]].clone()
        apply_penalties_inplace(shard, pen, bounds[r])
        shards.append(shard)
    got = torch.cat(shards, dim=1)
    assert torch.equal(got, want)
    assert got[0, 5] == float("-inf")


def test_no_penalties_means_no_entries():
    assert build_logit_penalties([(SamplingParams(), [1], [2])]) is None
    pen = build_logit_penalties(ROWS)
    assert 1 not in pen.rows.tolist()  # the neutral row sends nothing


def test_find_stop_string_across_tokens(tokenizer):
    ids = tokenizer.encode("Hello world. The end.", add_special_tokens=False)
    detok = lambda t: tokenizer.decode(list(t), skip_special_tokens=True)  # noqa: E731
    cuts = [find_stop_string(detok, ids[:k], ["world."]) for k in range(1, len(ids) + 1)]
    first = next(k for k, c in enumerate(cuts) if c is not None)
    assert detok(ids[:first + 1]).endswith("world.") or "world." in detok(ids[:first + 1])
    assert all(c is None for c in cuts[:first]) and cuts[first] == detok(ids).find("world.")
    assert find_stop_string(detok, ids, ["nope"]) is None


def test_device_copy_picks_its_shard_from_host_data():
    """A rank selects its entries from the host copy of the token ids: nothing is read back from the device.

    On the ``meta`` device (no values at all) any read of one would raise; the
    device copy still gives the dense oracle's bits once moved (here: to the CPU).
    """
    pen = build_logit_penalties(ROWS)
    on_meta = pen.to("meta")
    assert on_meta.host_token_ids is pen.token_ids and on_meta.to("meta").host_token_ids is pen.token_ids
    apply_penalties_inplace(torch.zeros(len(ROWS), V // 2, device="meta"), on_meta, V // 2)
    logits = torch.randn(len(ROWS), V, generator=torch.Generator().manual_seed(1))
    want = oracle(logits, ROWS)
    half = logits[:, V // 2:].clone()
    apply_penalties_inplace(half, pen.to("cpu"), V // 2)
    assert torch.equal(half, want[:, V // 2:])
