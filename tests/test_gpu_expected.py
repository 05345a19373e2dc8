"""A GPU job whose GPUs torch cannot see stops before its first step; the CPU takes an explicit choice.

What expects CUDA is what a cluster user's job carries: ``CUDA_VISIBLE_DEVICES`` naming devices (Slurm and
Kubernetes' device plugins set it), Slurm's GPU allocation (``SLURM_GPUS_ON_NODE``, ``SLURM_JOB_GPUS``...),
the NVIDIA container runtime's ``NVIDIA_VISIBLE_DEVICES``, the node's own GPUs (``/dev/nvidiaN``,
``/proc/driver/nvidia/gpus/*``: a fake node's tree under ``NEMO_ANCHOR_DEVICE_ROOT`` here), or a setting of
the run asking for GPUs. This machine has no GPU, so a job given ``CUDA_VISIBLE_DEVICES=0`` is what a container
started without its GPUs, or a node whose driver does not match, looks like: each front door (``nemo-anchor
train``, NeMo's ``llm.pretrain``) must stop with one line naming CUDA and torch's own error, and train on the CPU
only with ``NEMO_ANCHOR_ALLOW_CPU=1``; the commands that train nothing (import-hf, export-hf, eval, probe) say
once that the GPU is missing and run on the CPU. Bridge's door: tests/bridge/test_bridge_signals.py.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from nemo_anchor import launch
from nemo_anchor.cli import main
from tiny_runs import REPO, child_environment, pack_texts, tiny_config

# the NVIDIA driver's files on a node with one GPU: its device node, its /proc entry (under the node's root)
GPU_NODE_FILES = ("dev/nvidia0", "proc/driver/nvidia/gpus/0000:3b:00.0/information")
# and on a node without: the driver's control and memory devices alone, an empty /proc list
NO_GPU_NODE_FILES = ("dev/nvidiactl", "dev/nvidia-uvm", "dev/nvidia-uvm-tools", "dev/nvidia-modeset",
                     "proc/driver/nvidia/version")


def node_tree(root, files) -> str:
    """A node's root holding ``files`` (empty files, their folders made), as NEMO_ANCHOR_DEVICE_ROOT."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "proc/driver/nvidia/gpus").mkdir(parents=True)
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    return str(root)


@pytest.fixture
def no_gpu_job(monkeypatch, tmp_path):
    """This machine as a job that asks for no GPU, on a node without one, torch seeing none."""
    for name in launch.DEVICE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(launch.DEVICE_ROOT, node_tree(tmp_path / "no-gpu-node", ()))
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
    ("NVIDIA_VISIBLE_DEVICES", "all"), ("NVIDIA_VISIBLE_DEVICES", "0,1"), ("NVIDIA_VISIBLE_DEVICES", "GPU-8f6e4b2a"),
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
    ("NVIDIA_VISIBLE_DEVICES", "void"), ("NVIDIA_VISIBLE_DEVICES", "none"), ("NVIDIA_VISIBLE_DEVICES", ""),
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


@pytest.mark.parametrize("shown", GPU_NODE_FILES)
def test_a_node_with_an_nvidia_gpu_expects_cuda_without_any_variable(no_gpu_job, tmp_path, shown):
    """Bare-metal torchrun, a Slurm node given whole without --gres: nothing but the node says it has a GPU."""
    root = node_tree(tmp_path / "gpu-node", (shown, *NO_GPU_NODE_FILES))
    no_gpu_job.setenv(launch.DEVICE_ROOT, root)
    with pytest.raises(launch.CudaExpected) as refused:
        launch.cuda()
    assert f"CUDA is expected here (this node has {os.path.join(root, shown.split('/information')[0])})" \
        in str(refused.value)
    no_gpu_job.setenv(launch.ALLOW_CPU, "1")
    assert not launch.cuda() and launch.backend() == "gloo"


@pytest.mark.parametrize("variable, value", [("CUDA_VISIBLE_DEVICES", ""), ("NVIDIA_VISIBLE_DEVICES", "void"),
                                             ("NVIDIA_VISIBLE_DEVICES", "none"), (None, None)])
def test_devices_hidden_on_a_gpu_node_choose_the_cpu_and_the_drivers_files_alone_expect_nothing(
        no_gpu_job, tmp_path, variable, value):
    """A container given no GPU on a GPU node still reads the host's /proc/driver/nvidia/gpus."""
    root = node_tree(tmp_path / "gpu-node", GPU_NODE_FILES if variable else NO_GPU_NODE_FILES)
    no_gpu_job.setenv(launch.DEVICE_ROOT, root)
    if variable:
        no_gpu_job.setenv(variable, value)
    assert launch.cuda_expected() is None and not launch.cuda()


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
    for name in launch.DEVICE_VARIABLES:
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


def test_nemo_anchor_train_on_a_gpu_node_torch_cannot_see_stops_before_writing_anything(no_gpu_job, tmp_path, capsys):
    """No scheduler's variable at all: bare-metal torchrun on a node whose driver does not match its torch."""
    node = node_tree(tmp_path / "gpu-node", GPU_NODE_FILES)
    no_gpu_job.setenv(launch.DEVICE_ROOT, node)
    config = tiny_config(tmp_path / "run", pack_texts(tmp_path), max_steps=1)
    capsys.readouterr()
    assert main(["train", "--config", str(config)]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith(
        f"nemo-anchor train: error: CUDA is expected here (this node has {node}/dev/nvidia0)"), errors
    assert _torch_reason() in errors[0] and launch.ALLOW_CPU in errors[0]
    assert not (tmp_path / "run").exists()


def test_conversions_and_evaluations_on_a_gpu_node_torch_cannot_see_say_so_once_and_run_on_the_cpu(
        no_gpu_job, tmp_path, tiny_byte_llama, caplog):
    """import-hf, export-hf, eval and probe train nothing: the weights come out of a node whose GPUs are lost."""
    no_gpu_job.setenv(launch.DEVICE_ROOT, node_tree(tmp_path / "gpu-node", GPU_NODE_FILES))
    hf = tiny_byte_llama(tmp_path / "hf")
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": "Pack my box with five dozen liquor jugs. " * 4}) + "\n"
                            for _ in range(2)))
    commands = {
        "import-hf": ["import-hf", str(hf), str(tmp_path / "imported")],
        "export-hf": ["export-hf", str(tmp_path / "imported"), str(tmp_path / "exported")],
        "eval": ["eval", "--checkpoint", str(tmp_path / "imported"), "--output", str(tmp_path / "eval"),
                 "--tasks", "none", "--perplexity-data", str(text), "--perplexity-length", "32"],
        "probe": ["probe", "--checkpoint", str(tmp_path / "imported"), "--output", str(tmp_path / "probe"),
                  "--data", str(text), "--num-sequences", "1", "--sequence-length", "32", "--lengths", "32"],
    }
    for command, argv in commands.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert main(argv) == 0, command
        said = [r.getMessage() for r in caplog.records if "CUDA is expected" in r.getMessage()]
        assert len(said) == 1, (command, said)
        assert said[0].startswith(f"nemo-anchor {command}: warning: CUDA is expected here (this node has "
                                  f"{tmp_path / 'gpu-node' / 'dev' / 'nvidia0'}) but torch sees no CUDA device: ")
        assert _torch_reason() in said[0] and said[0].endswith("; running on the CPU")
    assert (tmp_path / "exported" / "config.json").is_file() and (tmp_path / "probe" / "probe.json").is_file()
    with pytest.raises(launch.CudaExpected):  # training in this process after them is still refused
        launch.cuda()


def test_nemos_recipe_built_on_a_login_node_asks_for_the_gpu_where_it_trains(no_gpu_job, tmp_path):
    """The recipe (accelerator "auto") decides nothing where it is built; its strategy, built by the training
    process, refuses a GPU node torch cannot see, and says what it trains on."""
    pytest.importorskip("nemo.collections.llm", reason="NeMo is not installed")
    import fiddle as fdl

    from nemo_anchor.nemo.recipes import anchor_smollm2_135m

    strategy = anchor_smollm2_135m().trainer.strategy  # on the login node: no GPU, nothing expects one
    assert launch.devices() == "accelerator cpu, fp32 over gloo (nothing here expects CUDA)"
    node = node_tree(tmp_path / "gpu-node", GPU_NODE_FILES)
    no_gpu_job.setenv(launch.DEVICE_ROOT, node)  # the node it trains on
    with pytest.raises(launch.CudaExpected, match=rf"CUDA is expected here \(this node has {node}/dev/nvidia0\)"):
        fdl.build(strategy)
    no_gpu_job.setenv(launch.ALLOW_CPU, "1")
    built = fdl.build(strategy)
    assert built.async_save is False and built.parallel_load is False
    assert launch.devices() == (f"accelerator cpu, fp32 over gloo ({launch.ALLOW_CPU}=1 where this node has "
                                f"{node}/dev/nvidia0 expects CUDA)")
    no_gpu_job.setattr(torch.cuda, "is_available", lambda: True)
    no_gpu_job.setattr(torch.cuda, "device_count", lambda: 8)
    assert launch.devices() == "accelerator gpu, 8 devices visible"
