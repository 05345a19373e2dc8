"""The ranks of one gloo group, forked from a process that has already imported what they run.

torchrun starts every worker as a new interpreter that imports torch and Megatron again (about 8 CPU s a process
here, 15 with Megatron-Bridge: 56 CPU s of imports for an 8-rank launch). torch's own elastic launcher, which
torchrun drives, can fork its workers instead (``start_method="fork"`` of
``torch.distributed.launcher.api.LaunchConfig``): the same agent, rendezvous and environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) as ``torchrun --standalone``, without the
imports. The tests of torchrun itself (signals, two nodes, a rank's one-line error) still launch torchrun:
tests/test_stop_save.py, tests/test_robust_runs.py, tests/bridge/test_bridge_signals.py (and, on a real Slurm
cluster, tests/test_slurm_cluster.py).
A command line's ranks: ``Preloaded.run(args, processes=N)`` (tests/preloaded.py).
"""
import uuid
from collections.abc import Callable

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def run_ranks(processes: int, entrypoint: Callable, *args) -> None:
    """``entrypoint(*args)`` on ``processes`` forked ranks of one machine; raises when any rank fails."""
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=processes, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0",  # a free port, as --standalone takes
                          max_restarts=0, start_method="fork", monitor_interval=0.5)
    elastic_launch(config, entrypoint)(*args)

