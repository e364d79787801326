"""`inferd eval` on the default model, small: the numbers exist, are sane, and order as they must."""
import json
import subprocess
import sys

import pytest
import torch

from inferd.eval import compare


def test_compare_identity_and_shift():
    lp = torch.log_softmax(torch.randn(9, 50), -1)
    t = torch.randint(0, 50, (8,))
    d = compare(lp, lp, t)
    assert float(d["kl"].max()) < 1e-6 and float(d["agree"].mean()) == 1.0
    other = torch.log_softmax(torch.randn(9, 50), -1)
    d2 = compare(lp, other, t)
    assert float(d2["kl"].mean()) > 0.1
    # KL by hand for one row
    p = lp[0].exp()
    assert abs(float((p * (lp[0] - other[0])).sum()) - float(d2["kl"][0])) < 1e-5


# the CLI itself: tests/test_readme.py runs the README's `inferd eval` command and checks its numbers
