"""Loading onto a device that is not the CPU: rows read from the file reach the parameter through a host buffer.

A checkpoint loaded at its own dtype (a bf16 one under ``--dtype auto`` on a
GPU, any under its dtype named) has its whole rows read by
:meth:`~tpguide.model.safetensors_reader.TensorSlice.read_rows_into`; it must
never call ``.numpy()`` on the (CUDA) target.  CI has no GPU, so the
non-CPU branch runs here on the ``meta`` device (a real non-CPU device) and,
for its bits, on CPU targets routed through the same host-buffer branch; on
a GPU (``launch/gpu_check.sh``) the CUDA case loads onto the device.
"""

import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.model import safetensors_reader
from tpguide.model.loader import load_model
from tpguide.model.random_checkpoint import tiny_hf_config, write_random_model
from tpguide.model.safetensors_reader import iter_checkpoint

VOCAB = 1000


def test_model_loads_at_its_dtype_onto_a_non_cpu_device(tmp_path):
    d = write_random_model(tmp_path, tiny_hf_config("LlamaForCausalLM", VOCAB), dtype=torch.bfloat16)
    model = load_model(d, TPGroup(device=torch.device("meta")), dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    assert all(p.device.type == "meta" for p in params.values())
    assert params["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_read_rows_into_a_non_cpu_target_goes_through_the_host_buffer(tmp_path):
    d = write_random_model(tmp_path, tiny_hf_config("Qwen3ForCausalLM", VOCAB), dtype=torch.float16)
    name, sl = next((n, s) for _, n, s in iter_checkpoint(d) if n == "model.embed_tokens.weight")
    target = torch.empty(7, *sl.get_shape()[1:], dtype=torch.float16, device="meta")
    assert not safetensors_reader.reads_in_place(target)
    assert sl.read_rows_into(target, 3) is target  # on the old reader: "can't convert meta ... to numpy"


def test_host_buffer_path_gives_the_bits_of_the_direct_read(tmp_path, monkeypatch):
    d = write_random_model(tmp_path, tiny_hf_config("LlamaForCausalLM", VOCAB), dtype=torch.bfloat16)
    direct = dict(load_model(d, TPGroup(), dtype=torch.bfloat16).named_parameters())
    calls = []
    monkeypatch.setattr(safetensors_reader, "reads_in_place", lambda dst: calls.append(dst.shape) is not None)
    monkeypatch.setattr(safetensors_reader, "BLOCK_BYTES", 1000)  # several blocks per tensor
    buffered = dict(load_model(d, TPGroup(), dtype=torch.bfloat16).named_parameters())
    assert calls, "the loader did not read any whole rows"
    for name, param in direct.items():
        assert torch.equal(buffered[name], param), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_checkpoint_loads_onto_cuda_with_the_bits_of_cpu(tmp_path, dtype):
    """The load that crashed on the first GPU try (fp32 rows into a CUDA parameter), and the converting one."""
    d = write_random_model(tmp_path, tiny_hf_config("LlamaForCausalLM", VOCAB), dtype=torch.float32)
    on_cpu = dict(load_model(d, TPGroup(), dtype=dtype).named_parameters())
    on_cuda = dict(load_model(d, TPGroup(device=torch.device("cuda")), dtype=dtype).named_parameters())
    for name, param in on_cpu.items():
        assert on_cuda[name].is_cuda and torch.equal(on_cuda[name].cpu(), param), name
