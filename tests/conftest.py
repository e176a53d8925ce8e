import pytest

import memplan


@pytest.fixture(scope="session")
def bert_large():
    return memplan.resolve_model("bert-large")


@pytest.fixture(scope="session")
def v100():
    return memplan.load_gpu("v100-16g")
