"""CUDA graphs are on by default, as vLLM's; ``--no-cuda-graphs`` and vLLM's ``--enforce-eager`` turn them off."""

import pytest
from cli_config import engine_config

from tpguide.engine import EngineConfig


@pytest.mark.parametrize("argv, on", [((), True), (("--cuda-graphs",), True), (("--no-cuda-graphs",), False),
                                      (("--enforce-eager",), False)])
def test_cuda_graph_flags(argv, on):
    assert engine_config(*argv).cuda_graphs is on
    assert EngineConfig().cuda_graphs is True
