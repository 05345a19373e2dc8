"""NeMo's ``nemo`` command with its import under the main guard: ``python tests/nemo_cli.py llm pretrain ...``
runs what ``nemo llm pretrain ...`` runs (the console script calls ``nemo_run.__main__:app`` the same way).

Why: megatron-core 0.16.1's checkpoint writer starts its results queue's Manager with "spawn"
(dist_checkpointing/strategies/filesystem_async.py:54), and a spawned child first runs its parent's main script
again. The ``nemo`` script imports NeMo-Run's CLI there, which loads every NeMo collection: about 13 CPU s and
800 MB per process that saves. From this script that child imports nothing of NeMo. The tests that are the user's
own command (tests/test_nemo_run.py's issue command, tests/test_gpu_expected.py, tests/test_nemo_lease.py) run
``nemo`` itself.
"""
import sys

if __name__ == "__main__":
    from nemo_run.__main__ import app

    sys.argv[0] = "nemo"
    sys.exit(app())
