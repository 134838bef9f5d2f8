import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser):
    parser.addoption("--regen-expected", action="store_true",
                     help="rewrite tests/expected/*.txt from the current output instead of comparing")


@pytest.fixture
def regen(request):
    return request.config.getoption("--regen-expected")
