import warnings

import pytest

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")


@pytest.fixture(autouse=True)
def _no_distributed_leak():
    """Tests that initialise torch.distributed in-process must tear it down."""
    yield
    from bebop_megatron.parallel import destroy_distributed

    destroy_distributed()
