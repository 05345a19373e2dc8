"""``scripts/slurm/train.sbatch`` and ``bridge.sbatch`` hand the overrides typed after them to the run unchanged.

The script runs as Slurm runs a batch script (bash, with the job's variables); ``srun``, ``scontrol`` and
``python`` (which runs scripts/slurm/torchrun.py, torchrun) on its PATH are the thinnest stand-ins that keep what
the script is responsible for: srun runs its command once, as a one-node job's task, and python records the
arguments it was given. tests/test_slurm_cluster.py and tests/bridge/test_bridge_slurm.py run the scripts on a real
Slurm cluster. What torchrun and the trainer do with the signals is tested elsewhere (tests/test_stop_save.py,
tests/test_cluster.py).
"""
import os
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

STANDINS = {
    # srun's options end where its command begins ("bash" here)
    "srun": '#!/bin/bash\nwhile [ "$1" != bash ]; do shift; done\nexec "$@"\n',
    "scontrol": '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && echo node0\n',
    "python": '#!/bin/bash\nprintf "%s\\0" "$@" > "$ARGV_FILE"\n',
}


OVERRIDES = ["checkpoint.allow_change=[o,p]", "run.name=two words", "data.note='quoted' \"too\"", "x=*"]


def _run_batch_script(tmp_path, script: str, **variables) -> list[str]:
    """``script`` run as Slurm runs it on one node, with OVERRIDES typed after it; the arguments python was given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STANDINS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    work = tmp_path / "work"  # files a glob of "[o,p]" would match, as in a user's working directory
    work.mkdir()
    for name in ("o", "p", ","):
        (work / name).write_text("")
    (work / "scripts").symlink_to(REPO / "scripts")  # the job runs from the repository: the scripts it sources
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node0",
           "SLURM_NNODES": "1", "SLURM_NODEID": "0", "ARGV_FILE": str(tmp_path / "argv"), **variables}
    done = subprocess.run(["bash", str(REPO / "scripts/slurm" / script), *OVERRIDES], cwd=work, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert argv[0] == "scripts/slurm/torchrun.py"
    assert argv[argv.index("--master-addr") + 1] == "node0"
    assert argv[argv.index("--nproc-per-node") + 1] == "8"
    return argv


def test_overrides_reach_torchrun_as_typed(tmp_path):
    argv = _run_batch_script(tmp_path, "train.sbatch", CONFIG="configs/my run.yaml")
    assert argv[argv.index("--config") + 1:] == ["configs/my run.yaml", *OVERRIDES]


def test_overrides_reach_bridge_as_typed(tmp_path):
    argv = _run_batch_script(tmp_path, "bridge.sbatch", RECIPE="anchor_smollm2_135m", SAVE="/runs/my run")
    assert argv[argv.index("-m") + 1:] == ["nemo_anchor.bridge.pretrain", "--recipe", "anchor_smollm2_135m",
                                           "checkpoint.save=/runs/my run", "checkpoint.load=/runs/my run", *OVERRIDES]
