"""A GPU job whose GPUs torch cannot see stops before its first step; the CPU takes an explicit choice.

What expects CUDA is what a cluster user's job carries: ``CUDA_VISIBLE_DEVICES`` naming devices (Slurm and
Kubernetes' device plugins set it), Slurm's GPU allocation (``SLURM_GPUS_ON_NODE``, ``SLURM_JOB_GPUS``...),
or a setting of the run asking for GPUs. This machine has no GPU, so a job given ``CUDA_VISIBLE_DEVICES=0``
is what a container started without its GPUs, or a node whose driver does not match, looks like: each front
door (``nemo-anchor train``, NeMo's ``llm.pretrain``) must stop with one line naming CUDA and torch's own
error, and train on the CPU only with ``NEMO_ANCHOR_ALLOW_CPU=1``. Bridge's door: tests/bridge/test_bridge_signals.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from nemo_anchor import launch
from tiny_runs import REPO, child_environment, pack_texts, tiny_config

# what a scheduler may leave in this test's own environment: the cases below set exactly what they test
_DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", launch.ALLOW_CPU, "SLURM_GPUS", "SLURM_GPUS_ON_NODE",
                     "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS")


@pytest.fixture
def no_gpu_job(monkeypatch):
    """This machine as a job that asks for no GPU, torch seeing none."""
    for name in _DEVICE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return monkeypatch


def _torch_reason() -> str:
    """torch's own error for this machine, found independently of nemo_anchor."""
    try:
        torch.cuda.init()
    except Exception as error:  # noqa: BLE001
        return str(error).split(".")[0]
    pytest.skip("torch initialises CUDA here")


@pytest.mark.parametrize("variable, value", [
    ("CUDA_VISIBLE_DEVICES", "0"), ("CUDA_VISIBLE_DEVICES", "GPU-8f6e4b2a,GPU-1c2d"), ("SLURM_GPUS_ON_NODE", "8"),
    ("SLURM_GPUS_PER_NODE", "h100:4"), ("SLURM_JOB_GPUS", "0,1,2,3"), ("SLURM_STEP_GPUS", "2"),
])
def test_a_job_given_gpus_that_torch_cannot_see_is_refused_naming_cuda_and_torchs_error(no_gpu_job, variable, value):
    no_gpu_job.setenv(variable, value)
    with pytest.raises(launch.CudaExpected) as refused:
        launch.cuda()
    message = str(refused.value)
    assert "\n" not in message and f"CUDA is expected here ({variable}={value})" in message
    assert _torch_reason() in message and launch.ALLOW_CPU in message
    for decided in (launch.backend, launch.mixed_precision, launch.async_save):  # every device choice asks first
        with pytest.raises(launch.CudaExpected):
            decided()


@pytest.mark.parametrize("variable, value", [
    (None, None), ("CUDA_VISIBLE_DEVICES", ""), ("CUDA_VISIBLE_DEVICES", "-1"), ("CUDA_VISIBLE_DEVICES", "NoDevFiles"),
    ("SLURM_GPUS_ON_NODE", "0"), ("SLURM_GPUS_PER_NODE", "h100:0"), ("SLURM_JOB_GPUS", ""),
])
def test_where_no_gpu_is_expected_the_cpu_stays_the_default(no_gpu_job, variable, value):
    if variable:
        no_gpu_job.setenv(variable, value)
    assert launch.cuda_expected() is None
    assert not launch.cuda() and launch.backend() == "gloo" and launch.mixed_precision() == "32"


def test_hidden_devices_win_over_the_allocation(no_gpu_job):
    """CUDA_VISIBLE_DEVICES="" on a node Slurm gave GPUs: the user hid them, and chose the CPU."""
    no_gpu_job.setenv("SLURM_GPUS_ON_NODE", "8")
    no_gpu_job.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not launch.cuda()


def test_the_cpu_is_an_explicit_choice_and_a_bad_choice_is_refused(no_gpu_job):
    no_gpu_job.setenv("CUDA_VISIBLE_DEVICES", "0")
    no_gpu_job.setenv(launch.ALLOW_CPU, "1")
    assert not launch.cuda() and launch.backend() == "gloo"
    no_gpu_job.setenv(launch.ALLOW_CPU, "maybe")
    with pytest.raises(ValueError, match=f"{launch.ALLOW_CPU}='maybe'"):
        launch.cuda()


def test_a_setting_that_asks_for_gpus_expects_cuda(no_gpu_job):
    with pytest.raises(launch.CudaExpected, match=r"CUDA is expected here \(dist.distributed_backend=nccl\)"):
        launch.cuda(asked_by="dist.distributed_backend=nccl")


def test_a_process_that_sees_cuda_trains_on_it(no_gpu_job):
    no_gpu_job.setattr(torch.cuda, "is_available", lambda: True)
    no_gpu_job.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert launch.cuda() and launch.backend() == "nccl"


# ---------------------------------------------------------------- the front doors, as a cluster user meets them

def _only(variables: dict) -> dict:
    env = child_environment(**variables)
    for name in _DEVICE_VARIABLES:
        if name not in variables:
            env.pop(name, None)
    return env


def test_nemo_anchor_train_stops_before_its_first_step_and_trains_on_the_cpu_when_chosen(tmp_path):
    data = pack_texts(tmp_path)
    config = tiny_config(tmp_path / "run", data, max_steps=2)
    command = [sys.executable, "-m", "nemo_anchor.cli", "train", "--config", str(config)]
    refused = subprocess.run(command, env=_only({"CUDA_VISIBLE_DEVICES": "0"}), cwd=REPO, capture_output=True,
                             text=True, timeout=600)
    errors = [line for line in refused.stderr.splitlines() if "error" in line]
    assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-3000:]
    assert errors[0].startswith("nemo-anchor train: error: CUDA is expected here (CUDA_VISIBLE_DEVICES=0)")
    assert _torch_reason() in errors[0] and launch.ALLOW_CPU in errors[0]
    assert not (tmp_path / "run").exists()  # nothing written: not even the output folder
    chosen = subprocess.run(command, env=_only({"CUDA_VISIBLE_DEVICES": "0", launch.ALLOW_CPU: "1"}), cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert chosen.returncode == 0, chosen.stderr[-3000:]
    assert "NEMO_ANCHOR_ALLOW_CPU=1: training on the CPU" in chosen.stderr
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert steps == [1, 2]


def test_nemo_llm_pretrain_stops_before_its_first_step_and_trains_on_the_cpu_when_chosen(tmp_path):
    pytest.importorskip("nemo.collections.llm", reason="NeMo is not installed")
    data = pack_texts(tmp_path)
    nemo = os.path.join(os.path.dirname(sys.executable), "nemo")
    command = [nemo, "llm", "pretrain", "--factory", "nemo_anchor.nemo.recipes.anchor_smollm2_135m",
               f"data.path={data}", "data.seq_length=64", "model.config.seq_length=64", "model.config.num_layers=1",
               "data.global_batch_size=1", "data.micro_batch_size=1", "trainer.devices=1", "trainer.max_steps=1",
               f"log.log_dir={tmp_path / 'log'}",
               "log.ckpt.save_last=False", "log.ckpt.save_top_k=0", "-y"]  # no save: a NeMo import less (spawn)
    refused = subprocess.run(command, env=_only({"CUDA_VISIBLE_DEVICES": "0"}), cwd=REPO, capture_output=True,
                             text=True, timeout=600)
    out = refused.stdout + refused.stderr
    named = [line for line in out.splitlines() if "CUDA is expected here (CUDA_VISIBLE_DEVICES=0)" in line]
    assert refused.returncode != 0 and len(named) == 1, out[-3000:]
    assert _torch_reason() in named[0] and launch.ALLOW_CPU in named[0]
    assert not (tmp_path / "log").exists()
    chosen = subprocess.run(command, env=_only({"CUDA_VISIBLE_DEVICES": "0", launch.ALLOW_CPU: "1"}), cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert chosen.returncode == 0, (chosen.stdout + chosen.stderr)[-3000:]
    metrics = tmp_path / "log" / "anchor_smollm2_135m" / "metrics.jsonl"
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"loss"' in line] == [1]
