"""torchrun as ``scripts/slurm/train.sbatch`` starts it on each node: the same launcher and arguments, but a stop
signal it forwarded ends it quietly instead of with a traceback.

On SIGTERM, SIGINT or SIGUSR1 (``--signals-to-handle``) torchrun passes the signal to its workers, waits for them
(the trainer saves and exits 75, printing one line that names the checkpoint), and then raises its own
``SignalException``: a 40-line traceback on every node and exit status 1, so that a planned stop read as a failure,
and srun's ``--kill-on-bad-exit`` ended the other nodes' torchrun while their workers were still saving. Here
that exception ends the launcher with status 0 and no output: the stop was asked for and the workers were given
it; the trainer's own line says what they saved, and the batch script's last line what comes next. Every other
end (a worker that failed, a rendezvous error) is torchrun's own, traceback and status included.

    python scripts/slurm/torchrun.py [torchrun arguments]
"""
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main

if __name__ == "__main__":
    try:
        main()
    except SignalException:
        sys.exit(0)
