import pytest
from hypothesis import settings

# the suite is deterministic: hypothesis draws the same examples on every run (CI included)
settings.register_profile("memplan", derandomize=True)
settings.load_profile("memplan")

import memplan


@pytest.fixture(scope="session")
def bert_large():
    return memplan.resolve_model("bert-large")


@pytest.fixture(scope="session")
def v100():
    return memplan.load_gpu("v100-16g")
