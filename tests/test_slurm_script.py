"""``scripts/slurm/train.sbatch`` hands the overrides typed after it to the trainer unchanged.

The script runs as Slurm runs a batch script (bash, with the job's variables); ``srun``, ``scontrol`` and
``python`` (which runs scripts/slurm/torchrun.py, torchrun) on its PATH are the thinnest stand-ins that keep what
the script is responsible for: srun runs its command once, as a one-node job's task, and python records the
arguments it was given. tests/test_slurm_cluster.py runs the script on a real Slurm cluster. What torchrun and the
trainer do with the signals is tested elsewhere (tests/test_stop_save.py, tests/test_cluster.py).
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


def test_overrides_reach_torchrun_as_typed(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STANDINS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    work = tmp_path / "work"  # files a glob of "[o,p]" would match, as in a user's working directory
    work.mkdir()
    for name in ("o", "p", ","):
        (work / name).write_text("")
    overrides = ["checkpoint.allow_change=[o,p]", "run.name=two words", "data.note='quoted' \"too\"", "x=*"]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CONFIG": "configs/my run.yaml",
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node0", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
           "ARGV_FILE": str(tmp_path / "argv")}
    done = subprocess.run(["bash", str(REPO / "scripts/slurm/train.sbatch"), *overrides], cwd=work, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert argv[0] == "scripts/slurm/torchrun.py"
    assert argv[argv.index("--config") + 1:] == ["configs/my run.yaml", *overrides]
    assert argv[argv.index("--master-addr") + 1] == "node0"
    assert argv[argv.index("--nproc-per-node") + 1] == "8"
