"""What the devices decide, decided by the process that trains on them, never by the one that builds the recipe.

Cluster users build a NeMo-Run recipe or a Megatron-Bridge ``ConfigContainer`` on a login node without
GPUs and train it elsewhere. So the recipes leave every device-dependent setting unset (``None``) and
the training process fills it here from the devices it sees:

- whether it trains on CUDA at all (:func:`cuda`): where CUDA is expected (:func:`cuda_expected`: the job
  was given GPUs, the node has NVIDIA GPUs, or the run asks for them) and torch sees no device, every
  front door stops before its first step, naming torch's own reason; the CPU then takes
  ``NEMO_ANCHOR_ALLOW_CPU=1``. Where nothing expects CUDA, no device means the CPU. The commands that
  train nothing (conversions, evaluation: :func:`cpu_capable`) say once that the GPU is missing and go on;
- Megatron's fusions (:data:`FUSIONS`) and CPU initialisation (:data:`DECIDED_AT_LAUNCH`, :func:`model_settings`):
  the fusions of Megatron-LM's Llama recipes on with CUDA and Transformer Engine (RoPE's only where
  :func:`rope_fusion_allowed`, weight-gradient accumulation only with apex's
  extension), off elsewhere;
- gradient reduction overlapped with the backward and the distributed optimizer's parameter
  all-gather with the next forward, and asynchronous checkpoint saves: with CUDA;
- bf16 mixed precision with CUDA, fp32 on the CPU (the NeMo and Bridge front doors; ``nemo-anchor
  train`` takes ``trainer.precision`` as written);
- the process-group backend: NCCL with CUDA, gloo without.

A value the user set is kept. What this process has no kernel for is turned off whatever was asked, and
without CUDA the weights are allocated on the CPU.
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from nemo_anchor import gpu

logger = logging.getLogger(__name__)

# the documented choice of the CPU where CUDA is expected
ALLOW_CPU = "NEMO_ANCHOR_ALLOW_CPU"
# Slurm's GPU requests ([type:]count, comma-separated) and allocations (device indices)
_SLURM_GPU_COUNTS = ("SLURM_GPUS", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK")
_SLURM_GPU_IDS = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS")
# the NVIDIA container runtime's devices (Docker's --gpus, Kubernetes' device plugin); "void" and "none" give none
NVIDIA_VISIBLE = "NVIDIA_VISIBLE_DEVICES"
_NVIDIA_NONE = ("void", "none")
# where this node's devices are looked for: "/" (tests point it at a fake node's tree)
DEVICE_ROOT = "NEMO_ANCHOR_DEVICE_ROOT"
# the NVIDIA driver's signs of a GPU: a device node per GPU (not nvidiactl, nvidia-uvm), a /proc entry per bus id
_NODE_GPUS = ("dev/nvidia[0-9]*", "proc/driver/nvidia/gpus/*")
# every variable that decides whether CUDA is expected here (what a test clears to start from none)
DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", *_SLURM_GPU_COUNTS, *_SLURM_GPU_IDS, NVIDIA_VISIBLE, ALLOW_CPU,
                    DEVICE_ROOT)

# Megatron's fusions that Megatron-LM's and NeMo's Llama recipes run on GPUs
FUSIONS = ("bias_activation_fusion", "cross_entropy_loss_fusion", "persist_layer_norm", "apply_rope_fusion",
           "gradient_accumulation_fusion")
# what every front door's recipes leave unset and the training process decides (model_settings)
DECIDED_AT_LAUNCH = (*FUSIONS, "use_cpu_initialization")


def global_rank() -> int:
    """This process's global rank before ``torch.distributed`` starts: torchrun's ``RANK``, else Slurm's
    ``SLURM_PROCID`` (``srun`` without torchrun, where every task would otherwise be rank 0), else 0."""
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def uses_yarn(config) -> bool:
    """Whether a model config (ours, Megatron's, NeMo's or Bridge's) describes YaRN RoPE."""
    return (getattr(config, "position_embedding_type", None) == "yarn" or getattr(config, "rope_scaling", None) == "yarn"
            or getattr(config, "yarn_rotary_scaling_factor", 1.0) != 1.0)


def rope_fusion_allowed(config) -> bool:
    """Whether Transformer Engine's fused RoPE computes what the model asks for.

    TE's kernel rotates in fp32 and rounds once; ``rope_in_fp32`` keeps Megatron's unfused fp32
    rotation (the option the paper measures stays exact), and YaRN keeps it too: Megatron's fused
    THD path drops YaRN's attention scaling (``mscale``).
    """
    return not getattr(config, "rope_in_fp32", False) and not uses_yarn(config)


class CudaExpected(ValueError):
    """CUDA is expected in this process and torch sees no device (bad input for the command: one line)."""


def node_gpus(root: str | os.PathLike | None = None) -> str | None:
    """The first NVIDIA GPU this node shows (its device node ``/dev/nvidiaN`` or the driver's
    ``/proc/driver/nvidia/gpus/BUS_ID``), or None. ``root``: where to look (default ``$NEMO_ANCHOR_DEVICE_ROOT``, else /)."""
    root = Path(root or os.environ.get(DEVICE_ROOT) or "/")
    for pattern in _NODE_GPUS:
        found = sorted(root.glob(pattern))
        if found:
            return str(found[0])
    return None


def cuda_expected(asked_by: str | None = None) -> str | None:
    """What expects CUDA in this process (``NAME=value``, or the node's GPU), or None.

    In order: ``asked_by``, a setting of the run that asks for GPUs, named by its front door (Bridge's
    ``dist.distributed_backend=nccl``); ``CUDA_VISIBLE_DEVICES`` naming a device (empty, ``-1`` or
    ``NoDevFiles`` hide them all: the CPU chosen); Slurm's GPUs; ``NVIDIA_VISIBLE_DEVICES`` naming devices
    ("all" included; "void" or "none" give the container none: the CPU chosen); the node's own GPUs
    (:func:`node_gpus`), which a job started without a scheduler's variables (bare-metal torchrun, a node
    given whole) still expects to use.
    """
    if asked_by:
        return asked_by
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        first = visible.split(",")[0].strip()
        hidden = not first or first.startswith("-") or first == "NoDevFiles"
        return None if hidden else f"CUDA_VISIBLE_DEVICES={visible}"
    for name in _SLURM_GPU_COUNTS:
        counts = [item.rpartition(":")[2].strip() for item in os.environ.get(name, "").split(",")]
        if any(count.isdigit() and int(count) > 0 for count in counts):
            return f"{name}={os.environ[name]}"
    for name in _SLURM_GPU_IDS:
        if os.environ.get(name, "").strip():
            return f"{name}={os.environ[name]}"
    container = os.environ.get(NVIDIA_VISIBLE, "").strip()
    if container.lower() in _NVIDIA_NONE:
        return None  # the driver's /proc entries show through a container given no GPU
    if container:
        return f"{NVIDIA_VISIBLE}={os.environ[NVIDIA_VISIBLE]}"
    device = node_gpus()
    return f"this node has {device}" if device else None


def cpu_chosen() -> bool:
    """Whether ``NEMO_ANCHOR_ALLOW_CPU`` chooses the CPU where CUDA is expected (1/true/yes; 0/false/no/unset: not)."""
    value = os.environ.get(ALLOW_CPU, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ValueError(f"{ALLOW_CPU}={os.environ[ALLOW_CPU]!r}: set it to 1 to train on the CPU where CUDA is "
                     f"expected, or leave it unset")


def _cuda_error() -> str:
    """torch's own reason for seeing no device: ``torch.cuda.is_available()`` hides it, ``torch.cuda.init()`` raises it."""
    try:
        torch.cuda.init()
    except Exception as error:  # noqa: BLE001 - whatever torch raises is the reason to report
        reason = f"{type(error).__name__}: {error}"
    else:
        reason = f"torch.cuda.device_count() is {torch.cuda.device_count()}"
    return " ".join(f"{reason} (torch {torch.__version__})".split())


_cpu_announced = False
_cpu_capable: list[str] = []  # the commands running that need no GPU (cpu_capable), innermost last


@contextlib.contextmanager
def cpu_capable(command: str):
    """Run ``command``, which trains nothing (a conversion, an evaluation), on the CPU where CUDA is expected
    and torch sees no device: it says so in one warning line on entry and goes on, where a training door stops
    (:func:`cuda`). That is when a user wants the weights out of a node whose GPUs are lost.

    Raises:
        ValueError: ``NEMO_ANCHOR_ALLOW_CPU`` has another value than 1/true/yes/0/false/no.
    """
    cpu_chosen()
    if not _cpu_capable and not torch.cuda.is_available():
        expected = cuda_expected()
        if expected:
            logger.warning("%s: warning: CUDA is expected here (%s) but torch sees no CUDA device: %s; running on the CPU",
                           command, expected, _cuda_error())
    _cpu_capable.append(command)
    try:
        yield
    finally:
        _cpu_capable.pop()


def cuda(asked_by: str | None = None) -> bool:
    """Whether this process trains on CUDA: torch sees a device.

    Raises:
        CudaExpected: CUDA is expected here (:func:`cuda_expected`) and torch sees no device, outside a
            :func:`cpu_capable` command, and ``NEMO_ANCHOR_ALLOW_CPU`` does not choose the CPU: one line naming
            what expects CUDA and torch's reason.
        ValueError: ``NEMO_ANCHOR_ALLOW_CPU`` has another value than 1/true/yes/0/false/no.
    """
    global _cpu_announced
    allowed = cpu_chosen()
    if torch.cuda.is_available():
        return True
    expected = cuda_expected(asked_by)
    if not expected or _cpu_capable:  # a CPU-capable command said so on entry
        return False
    if not allowed:
        raise CudaExpected(f"CUDA is expected here ({expected}) but torch sees no CUDA device: {_cuda_error()}; "
                           f"run where the GPUs are visible, or set {ALLOW_CPU}=1 to train on the CPU (fp32 over gloo)")
    if not _cpu_announced:
        logger.warning("CUDA is expected here (%s) but torch sees no CUDA device; %s=1: training on the CPU",
                       expected, ALLOW_CPU)
        _cpu_announced = True
    return False


def devices() -> str:
    """What this process trains on, as a run's log says it (:func:`cuda`'s decision, so it refuses first where CUDA is
    expected and absent): "accelerator gpu, N devices visible" or "accelerator cpu" and why."""
    if cuda():
        return f"accelerator gpu, {torch.cuda.device_count()} devices visible"
    expected = cuda_expected()
    return (f"accelerator cpu, fp32 over gloo ({ALLOW_CPU}=1 where {expected} expects CUDA)" if expected
            else "accelerator cpu, fp32 over gloo (nothing here expects CUDA)")


def model_settings(*, rope_allowed: bool) -> dict[str, bool]:
    """Each of :data:`DECIDED_AT_LAUNCH` as this process's devices decide: the fusions on where CUDA and
    Transformer Engine's kernels are (RoPE's only where ``rope_allowed``; weight-gradient accumulation also
    needs apex's ``fused_weight_gradient_mlp_cuda``, which Megatron's own linear layers require for it),
    CPU initialisation without CUDA."""
    on_gpu = cuda()
    kernels = on_gpu and gpu.transformer_engine_pytorch()[0] is not None
    settings = {name: kernels for name in FUSIONS}
    settings["apply_rope_fusion"] = kernels and rope_allowed
    settings["gradient_accumulation_fusion"] = kernels and gpu.apex_gradient_accumulation()[0] is not None
    settings["use_cpu_initialization"] = not on_gpu
    return settings


def resolve_model_config(config) -> None:
    """Fill a Megatron ``TransformerConfig``'s (or provider's) :data:`DECIDED_AT_LAUNCH` in place: an unset
    (None) one as :func:`model_settings` decides, a fusion this process has no kernel for off, and CPU
    initialisation without CUDA, whatever was asked.

    Raises:
        ValueError: ``apply_rope_fusion`` set on a model whose RoPE the fused kernel gets wrong (YaRN, ``rope_in_fp32``).
    """
    allowed = rope_fusion_allowed(config)
    if config.apply_rope_fusion and not allowed:
        raise ValueError("apply_rope_fusion=True with YaRN or rope_in_fp32: Megatron's fused THD RoPE drops YaRN's "
                         "attention scaling, and rope_in_fp32 asks for the unfused fp32 rotation; leave it unset")
    settings = model_settings(rope_allowed=allowed)
    for name in FUSIONS:
        setattr(config, name, settings[name] and getattr(config, name) is not False)
    if settings["use_cpu_initialization"] or config.use_cpu_initialization is None:
        config.use_cpu_initialization = settings["use_cpu_initialization"]


def resolve_ddp_config(ddp) -> None:
    """Fill a Megatron ``DistributedDataParallelConfig``'s unset overlaps (None) in place: on with CUDA,
    the parameter all-gather's only with the distributed optimizer (whose all-gather it is)."""
    if ddp.overlap_grad_reduce is None:
        ddp.overlap_grad_reduce = cuda()
    if ddp.overlap_param_gather is None:
        ddp.overlap_param_gather = cuda() and ddp.use_distributed_optimizer


def mixed_precision() -> str:
    """The precision a recipe that leaves it unset trains in here: NeMo / Lightning's names."""
    return "bf16-mixed" if cuda() else "32"


def backend() -> str:
    """The ``torch.distributed`` backend for this process's devices."""
    return "nccl" if cuda() else "gloo"


def async_save() -> bool:
    """Whether checkpoints can be written asynchronously here (Megatron's async writer needs CUDA)."""
    return cuda()


AUTO = "auto"  # a Megatron-Bridge recipe's mixed_precision / dist.distributed_backend left to the devices


def resolve_bridge_config(config) -> None:
    """Fill a Megatron-Bridge ``ConfigContainer``'s unset device choices in place, before its ``pretrain()``.

    ``mixed_precision`` and ``dist.distributed_backend`` "auto", the DDP overlaps and
    ``checkpoint.async_save`` None (``nemo_anchor.bridge.recipes`` leaves them so). The model's
    choices are the provider's ``finalize()``, which ``pretrain()`` calls. A ``distributed_backend``
    of "nccl" asks for GPUs (:func:`cuda`).
    """
    asked = "dist.distributed_backend=nccl" if config.dist.distributed_backend == "nccl" else None
    on_gpu = cuda(asked_by=asked)
    if config.mixed_precision == AUTO:
        config.mixed_precision = "bf16_mixed" if on_gpu else None
    if config.dist.distributed_backend == AUTO:
        config.dist.distributed_backend = backend()
    resolve_ddp_config(config.ddp)
    if config.checkpoint.async_save is None:
        config.checkpoint.async_save = async_save() and config.checkpoint.save is not None
