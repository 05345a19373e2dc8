"""Megatron-Bridge's front door stops as the other two do (.venv-bridge; each run a subprocess, as a user runs it).

- SIGUSR1 (Slurm's ``--signal=USR1@120``) and SIGINT to the whole process group, after scheduled saves: the run
  saves the step it reached and exits 75, none of its processes is left, and the same command resumes from that
  checkpoint (SIGTERM: tests/bridge/test_bridge.py). Its log names the signal (Bridge's own line said SIGTERM
  whatever came) and ends with the trainer's line naming the signal, the checkpoint and what next; no traceback in
  it (Bridge logged its planned exit as "Pretrain failed ... SystemExit: 0", and every run began with an import
  traceback).
- A job given GPUs that torch cannot see (``CUDA_VISIBLE_DEVICES=0`` on this machine), or a run asking for NCCL,
  stops before its first step with one line naming CUDA and torch's error; with ``NEMO_ANCHOR_ALLOW_CPU=1`` it
  trains on the CPU (the SIGUSR1 run above is that job). The other variables that give a job GPUs (Slurm's)
  reach the same ``launch.cuda()``: tests/test_gpu_expected.py refuses each of them. So does a node with an NVIDIA
  GPU (a fake node's tree under ``NEMO_ANCHOR_DEVICE_ROOT``), where Bridge's conversions say so once and convert.

Skipped where Megatron-Bridge is not installed.
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.bridge") is None:  # checked before nemo_anchor.bridge installs its shims
    pytest.skip("Megatron-Bridge is not installed (scripts/setup_env.sh's .venv-bridge has it)", allow_module_level=True)

from nemo_anchor import launch  # noqa: E402
from tiny_runs import pack_texts  # noqa: E402  tests/tiny_runs.py

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["The quick brown fox jumps over the lazy dog. " * 6, "Pack my box with five dozen liquor jugs! " * 4,
         "How vexingly quick daft zebras jump; " * 9, "Waltz, bad nymph, for quick jigs vex. " * 12] * 6


@pytest.fixture(scope="module")
def run_config(tmp_path_factory):
    """A `nemo-anchor train` YAML of a tiny model over packed byte windows of 64 tokens."""
    root = tmp_path_factory.mktemp("bridge-signals")
    packed = pack_texts(root, TEXTS, name="packed")
    config = root / "run.yaml"
    config.write_text(json.dumps({
        "output_dir": str(root / "unused"),
        "model": {"num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
                  "num_query_groups": 2, "seq_length": 64, "attention_type": "anchor", "rotary_base": "10000"},
        "data": {"path": str(packed)},
        "trainer": {"max_steps": 400, "global_batch_size": 1, "micro_batch_size": 1, "precision": "fp32",
                    "progress_bar": False, "eval_batches": 0},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
    }))
    return config


def environment(**variables) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in launch.DEVICE_VARIABLES}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **variables}


def command(config, save, *overrides) -> list[str]:
    return [sys.executable, "-m", "nemo_anchor.bridge.pretrain", "--config", str(config), f"checkpoint.save={save}",
            f"checkpoint.load={save}", "--peak-tflops", "1", *overrides]


def steps(save: Path) -> list[int]:
    metrics = save / "metrics.jsonl"
    rows = metrics.read_text().splitlines() if metrics.is_file() else []
    return [json.loads(row)["step"] for row in rows if '"loss"' in row]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# the SIGUSR1 run is a Slurm job on a node whose GPUs torch cannot see, told to train on the CPU
CPU_CHOSEN_WHERE_CUDA_IS_EXPECTED = {"CUDA_VISIBLE_DEVICES": "0", launch.ALLOW_CPU: "1"}


@pytest.mark.parametrize("stop, variables", [(signal.SIGUSR1, CPU_CHOSEN_WHERE_CUDA_IS_EXPECTED), (signal.SIGINT, {})],
                         ids=["SIGUSR1", "SIGINT"])
def test_a_group_stop_signal_after_earlier_saves_saves_the_step_reached_and_exits_75(run_config, stop, variables,
                                                                                     pretrain_cli, tmp_path):
    save = tmp_path / "run"
    run = subprocess.Popen(command(run_config, save, "checkpoint.save_interval=2"), env=environment(**variables),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 500
        while len(steps(save)) < 5 and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert run.poll() is None and len(steps(save)) >= 5, run.communicate()[0][-3000:] if run.poll() is not None \
            else "slow"
        os.killpg(run.pid, stop)  # as Slurm's --signal=USR1@120 reaches every task, or ^C a terminal's group
        out = run.communicate(timeout=300)[0]
        deadline = time.monotonic() + 60  # the writer's helper processes end with the run
        while group_alive(run.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = group_alive(run.pid)
    finally:
        if group_alive(run.pid):
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 75, out[-3000:]
    latest = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert latest == max(steps(save)) >= 5 and (save / f"iter_{latest:07d}").is_dir(), (latest, steps(save))
    assert not left, "processes of the run were left alive"
    assert "Traceback" not in out and "Pretrain failed" not in out, out[-3000:]
    assert f"[exiting program after receiving {stop.name}.]" in out, out[-3000:]
    assert out.splitlines()[-1] == (f"stop requested ({stop.name}): saved {save / f'iter_{latest:07d}'} at step "
                                    f"{latest}; run the same command again to resume"), out[-3000:]
    # the same command resumes from the stop's checkpoint (forked from tests/preloaded.py: its start is not under test)
    resumed = pretrain_cli.run(command(run_config, save, f"train.train_iters={latest + 1}")[3:])
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert steps(save) == list(range(1, latest + 2))  # continued after the step saved, none replayed


def _torch_reason() -> str:
    try:
        torch.cuda.init()
    except Exception as error:  # noqa: BLE001
        return str(error).split(".")[0]
    pytest.skip("torch initialises CUDA here")


@pytest.mark.parametrize("asked, expected", [
    ({"CUDA_VISIBLE_DEVICES": "0"}, "CUDA_VISIBLE_DEVICES=0"),
    ({"overrides": "dist.distributed_backend=nccl"}, "dist.distributed_backend=nccl"),
], ids=["CUDA_VISIBLE_DEVICES", "nccl"])
def test_a_gpu_job_that_sees_no_gpu_stops_before_its_first_step(run_config, asked, expected, tmp_path):
    overrides = [asked.pop("overrides")] if "overrides" in asked else []
    done = subprocess.run(command(run_config, tmp_path / "run", "train.train_iters=1", *overrides),
                          env=environment(**asked), capture_output=True, text=True, timeout=600)
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 2 and len(errors) == 1, (done.stdout + done.stderr)[-3000:]
    assert errors[0].startswith(f"python -m nemo_anchor.bridge.pretrain: error: CUDA is expected here ({expected})")
    assert _torch_reason() in errors[0] and launch.ALLOW_CPU in errors[0]
    assert not (tmp_path / "run").exists()


@pytest.fixture
def gpu_node_torch_cannot_see(monkeypatch, tmp_path):
    """This process as a job on a node with an NVIDIA GPU (its device node) that torch does not see."""
    for name in launch.DEVICE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "node" / "dev").mkdir(parents=True)
    (tmp_path / "node" / "dev" / "nvidia0").write_text("")
    monkeypatch.setenv(launch.DEVICE_ROOT, str(tmp_path / "node"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return f"this node has {tmp_path / 'node' / 'dev' / 'nvidia0'}"


def test_bridges_recipe_refuses_a_gpu_node_torch_cannot_see_where_it_trains(gpu_node_torch_cannot_see):
    from nemo_anchor.bridge.recipes import anchor_smollm2_135m

    config = anchor_smollm2_135m()  # built anywhere: the devices are decided by resolve_bridge_config
    with pytest.raises(launch.CudaExpected, match=f"CUDA is expected here \\({gpu_node_torch_cannot_see}\\)"):
        launch.resolve_bridge_config(config)


def test_bridges_conversions_on_a_gpu_node_torch_cannot_see_say_so_once_and_convert(gpu_node_torch_cannot_see,
                                                                                  tiny_byte_llama, tmp_path, caplog):
    from nemo_anchor.bridge import convert

    hf = tiny_byte_llama(tmp_path / "hf")
    for argv in (["import-hf", str(hf), str(tmp_path / "megatron")],
                 ["export-hf", str(tmp_path / "megatron"), str(tmp_path / "back")]):
        caplog.clear()
        convert.main(argv)
        said = [r.getMessage() for r in caplog.records if "CUDA is expected" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith(
            f"python -m nemo_anchor.bridge.convert {argv[0]}: warning: CUDA is expected here "
            f"({gpu_node_torch_cannot_see}) but torch sees no CUDA device: "), said
    assert (tmp_path / "back" / "config.json").is_file()
