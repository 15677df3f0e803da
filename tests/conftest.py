"""Every test starts from the same global random state, so its outcome does not depend on which tests ran before."""
import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_global_generators():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
