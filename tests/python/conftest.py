import os
import sys

import pytest

# Tests import the package from the source tree and the harness from here;
# spawned ranks inherit this sys.path.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
for path in (_HERE, os.path.join(_ROOT, "python")):
    if path not in sys.path:
        sys.path.insert(0, path)


@pytest.fixture(scope="module")
def group():
    """A one-rank smp process group in this process, for the whole module (test_ops,
    test_cp_ops, test_moe_ops call their ops on it); destroyed after the module's last test."""
    import smp  # noqa: F401  (registers the "smp" backend)
    import torch.distributed as dist

    assert not dist.is_initialized(), "another test left torch.distributed initialized"
    dist.init_process_group("smp", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def pytest_addoption(parser):
    parser.addoption(
        "--slow",
        action="store_true",
        help="also run the long variants (marked slow); the default suite stays under 40 minutes on 2 cores",
    )


def pytest_collection_modifyitems(config, items):
    # The long variants (more processes, bigger matrices) of tests whose short forms run by default.
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: a long variant; run it with `bash tests/run.sh --slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
