# Sourced by the batch scripts beside it (train.sbatch, bridge.sbatch), from the repository (the job's working
# directory): one torchrun per node, the time-limit signal passed on, and a planned stop's requeue and last line.
#
#   torchrun_on_each_node NPROC_PER_NODE PROGRAM [ARG...]   srun: one scripts/slurm/torchrun.py per node, running
#       PROGRAM (a script, or -m MODULE) with ARGs on NPROC_PER_NODE workers; returns srun's status, and sets STOP
#       to SIGUSR1 or SIGTERM when one came meanwhile (empty otherwise)
#   end_planned_stop NEWEST   after a stop: requeues the job on SIGUSR1; one line: the signal, the checkpoint NEWEST,
#       what comes next
#
# The batch script needs `#SBATCH --requeue` and `#SBATCH --signal=B:USR1@<seconds>` (see docs/cluster.md).

STOP=""
SRUN_PID=""

# The time limit is near (SIGUSR1 to the batch script): pass it on (srun forwards it to each node's torchrun,
# torchrun to its workers: they finish the step, save a checkpoint and exit 75); end_planned_stop then puts the job
# back in the queue. A preemption, `scontrol requeue` or `scancel` sends SIGTERM to every process of the job, srun's
# tasks included: the script only notes it, waits for the save and says what comes next.
#
# scripts/slurm/torchrun.py is torchrun, quiet after a stop signal it forwarded (no traceback, status 0).
# --signals-to-handle: torchrun forwards SIGUSR1 too (its default is SIGTERM,SIGINT,SIGHUP,SIGQUIT).
# --shutdown-timeout: how long torchrun waits for the workers' save before SIGKILL (default 30 s).
# A preemption sends SIGTERM to every process of the job; Slurm's KillWait bounds the save then.
# The arguments travel as arguments of `bash -c`, not pasted into its text: spaces, quotes and [a,b] lists reach the
# program as typed (no word splitting, no globbing against the node's working directory).
torchrun_on_each_node() {
    local head port status
    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    port=${MASTER_PORT:-29500}
    echo "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST"
    trap 'STOP=SIGUSR1; kill -USR1 "$SRUN_PID" 2>/dev/null' USR1
    trap 'STOP=SIGTERM' TERM
    srun --kill-on-bad-exit=1 bash -c 'exec python scripts/slurm/torchrun.py \
        --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --nproc-per-node "$0" \
        --master-addr "$1" --master-port "$2" \
        --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout 110 \
        "${@:3}"' "$1" "$head" "$port" "${@:2}" &
    SRUN_PID=$!
    wait "$SRUN_PID"; status=$?        # returns early when a trap ran: wait on for srun's own status
    while kill -0 "$SRUN_PID" 2>/dev/null; do wait "$SRUN_PID"; status=$?; done
    return "$status"
}

end_planned_stop() {
    if [ "$STOP" = SIGUSR1 ]; then
        scontrol requeue "$SLURM_JOB_ID"
        echo "job $SLURM_JOB_ID stopped on SIGUSR1 (time limit near), newest checkpoint $1: requeued, the job runs" \
             "again and resumes from it"
    else  # the job's state reads COMPLETING both for a requeue and for scancel: neither is known here
        echo "job $SLURM_JOB_ID stopped on SIGTERM (preempted, requeued or cancelled), newest checkpoint $1: a" \
             "requeued job resumes from it; after scancel, the same sbatch command does"
    fi
}
