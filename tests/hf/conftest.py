"""Hugging Face front-end tests: the unmodified ``transformers`` GlmMoeDsaForCausalLM vs the same model
compiled with the backend. Compiles are cached per configuration for the whole session (each one
traces a whole model), so the numeric and the structural tests share them."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _hf_process_settings():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls on 2 shared cores
    try:
        with torch._dynamo.config.patch(recompile_limit=64):
            yield
    finally:
        torch.set_num_threads(threads)
