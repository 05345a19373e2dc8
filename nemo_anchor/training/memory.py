"""Per-GPU memory of a training run: planned from the config before launch, measured in a running engine.

The plan follows what Megatron-Core allocates for the engine in :mod:`nemo_anchor.training.engine`:

- weights: this rank's parameters (tensor- and pipeline-parallel shard) in the compute dtype. With
  the distributed optimizer they live in DDP's padded parameter buffer;
- gradients: DDP's fp32 gradient buffer (``grad_reduce_in_fp32``), padded as Megatron pads it;
- optimizer: AdamW's two fp32 moments, plus fp32 master weights in bf16 runs, for the slice of the
  buffer this data x context-parallel rank owns (all of it without the distributed optimizer);
- activations: what autograd saves for backward over one micro-batch (attention kernels that never
  store the T x T scores), for the recompute policy, times the micro-batches a pipeline stage holds;
- logits: the output layer's logits and the fp32 softmax of the vocabulary-parallel cross entropy;
- keys and values beyond the layer's own: under context parallelism with ``all_gather`` every
  layer keeps the whole window's gathered K/V for its backward. The anchor adds none: every
  backend that runs ``anchor`` mode merges it through the log-sum-exp
  (:mod:`nemo_anchor.attention.anchor_merge`), recomputing its one score per query in the backward;
- communication: the sequence-parallel all-gather of one layer's input and an all-to-all (Ulysses)
  buffer of one layer's keys and values;
- headroom: 5% of the GPU left to PyTorch's caching allocator (fragmentation), on top of the
  CUDA context reserve.

The GPU is given by its nominal size or name (:func:`gpu_memory`): an "80 GB" H100 offers 79.11 GiB
to PyTorch. ``fusions=True`` plans Megatron's fused paths (what a GPU with Transformer Engine runs):
the fused cross entropy works on the bf16 logits in place (no fp32 copy of them), the fused
bias-SwiGLU saves only its input (not the two activation intermediates).

:func:`state_bytes` measures the first three in a live engine, from the tensors themselves.
"""
from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, replace

import torch

from nemo_anchor.model.config import ModelConfig

GIB = 1024 ** 3
# Megatron's DistributedDataParallelConfig default bucket size: max(40M, 1M x data-parallel size) params
_BUCKET_BASE, _BUCKET_PER_RANK = 40_000_000, 1_000_000
_CUDA_CONTEXT_BYTES = 2 * GIB  # CUDA context, cuBLAS/NCCL workspaces
ALLOCATOR_HEADROOM = 0.05  # of the GPU's usable memory, left free for the caching allocator's fragmentation


@dataclass(frozen=True)
class GpuCard:
    """A GPU model: its nominal memory, what PyTorch can allocate of it, and where that number comes from."""

    name: str
    nominal_gb: float
    usable_gib: float
    source: str


# measured: an H100 80GB offers 79.11 GiB to PyTorch (the total in its out-of-memory message);
# nominal sizes without a measurement are scaled by that ratio
_USABLE_PER_NOMINAL = 79.11 / 80
GPU_CARDS = {
    "h100-80gb": GpuCard("H100 80GB", 80, 79.11, "measured: PyTorch's out-of-memory total on an H100 80GB"),
    "a100-80gb": GpuCard("A100 80GB", 80, 79.15, "PyTorch's out-of-memory total reported for A100 80GB; "
                                                 "not measured by this project"),
    "h200": GpuCard("H200 141GB", 141, 139.8, "torch.cuda total_memory reported for H200; "
                                              "not measured by this project"),
    "b200": GpuCard("B200 180GB", 180, round(180 * _USABLE_PER_NOMINAL, 2),
                    "estimate: 180 GB scaled by the H100's usable share; not measured"),
}


def gpu_memory(spec: str | float) -> tuple[int, str]:
    """(bytes PyTorch can allocate, a description) of a GPU given by name (``GPU_CARDS``) or nominal size
    in GB (80: an H100 / A100 80GB; other sizes scaled by the H100's measured usable share).

    Raises:
        ValueError: neither a known card nor a finite size greater than 0.
    """
    text = str(spec).strip().lower()
    if text in GPU_CARDS:
        card = GPU_CARDS[text]
        return int(card.usable_gib * GIB), f"{card.name}: {card.usable_gib:g} GiB usable ({card.source})"
    try:
        nominal = float(text)
    except ValueError:
        nominal = math.nan
    if not math.isfinite(nominal) or nominal <= 0:
        raise ValueError(f"{spec!r} is neither a GPU ({', '.join(GPU_CARDS)}) nor a finite size in GB greater than 0")
    if not math.isfinite(nominal * GIB):  # the plan counts bytes
        raise ValueError(f"{spec!r} GB is more bytes than a float holds (at most {sys.float_info.max / GIB:.3g} GB)")
    if nominal == 80:
        card = GPU_CARDS["h100-80gb"]
        return int(card.usable_gib * GIB), f"80 GB (H100/A100 80GB): {card.usable_gib:g} GiB usable ({card.source})"
    usable = nominal * _USABLE_PER_NOMINAL
    return int(usable * GIB), f"{nominal:g} GB: {usable:.2f} GiB usable (estimated with the H100's usable share)"


@dataclass(frozen=True)
class Layout:
    gpus: int
    tensor: int = 1
    pipeline: int = 1
    context: int = 1

    @property
    def data(self) -> int:
        return self.gpus // (self.tensor * self.pipeline * self.context)


def parameter_groups(model: ModelConfig, vocab_size: int, tensor: int = 1, pipeline: int = 1,
                     stage: int = 0) -> list[tuple[list[int], int]]:
    """The parameters one tensor-parallel rank of pipeline ``stage`` holds, in module order (the order
    DDP lays its buffer out in, reversed), as (elements of each parameter of a group, times the group
    repeats): the layers are one group repeated, so nothing here grows with the layer count."""
    h, d = model.hidden_size, model.kv_channels
    q, kv, ffn = model.num_attention_heads * d, model.num_query_groups * d, model.ffn_hidden_size
    first, last = stage == 0, stage == pipeline - 1
    # input_layernorm, linear_proj, linear_qkv (+ bias), pre_mlp_layernorm, linear_fc1, linear_fc2
    layer = [h, h * q // tensor, (q + 2 * kv) // tensor * h] + ([(q + 2 * kv) // tensor] if model.qkv_bias else [])
    layer += [h, 2 * ffn // tensor * h, h * ffn // tensor]
    groups = [([vocab_size // tensor * h], 1)] if first else []  # the word embeddings
    groups.append((layer, model.num_layers // pipeline))
    if last:  # the final norm, and the output layer unless tied (a tied last stage holds its own copy)
        groups.append(([h] + ([vocab_size // tensor * h] if not model.tie_embeddings or not first else []), 1))
    return groups


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _padded_buffer_elements(groups: list[tuple[list[int], int]], data_parallel: int) -> int:
    """Elements of the parameter buffer Megatron's ``_ParamAndGradBuffer`` allocates for the distributed
    optimizer: parameters in reverse order at 64-element aligned starts, a bucket closed once it holds
    ``bucket_size`` elements and padded to lcm(dp, 128)."""
    bucket_size = max(_BUCKET_BASE, _BUCKET_PER_RANK * data_parallel)
    divisor = math.lcm(data_parallel, 128)
    closed = filled = 0  # elements of the closed buckets (padded); of the open one
    for pattern, repeats in reversed(groups):
        closed, filled = _lay_out(pattern[::-1], repeats, closed, filled, bucket_size, divisor)
    return closed + _round_up(filled, divisor)


def _lay_out(pattern: list[int], repeats: int, closed: int, filled: int, bucket_size: int,
             divisor: int) -> tuple[int, int]:
    """Places ``pattern`` ``repeats`` times into the buffer; returns the new (closed, filled).

    Closed form in ``repeats``: passes that close no bucket are skipped in one step, and once a bucket
    closes at a parameter index seen before, the buckets since then repeat and are skipped as a whole."""
    n, total = len(pattern), len(pattern) * repeats
    period = sum(_round_up(numel, 64) for numel in pattern)
    last_end = period - _round_up(pattern[-1], 64) + pattern[-1]  # where a pass's last parameter ends
    remaining, seen = total, {}
    while remaining:
        index = (total - remaining) % n
        if index == 0:
            start = _round_up(filled, 64)
            quiet = min(remaining // n, max(0, -(-(bucket_size - start - last_end) // period)))
            if quiet:  # whole passes whose last parameter ends below the bucket size
                filled, remaining = start + (quiet - 1) * period + last_end, remaining - quiet * n
                continue
        filled, remaining = _round_up(filled, 64) + pattern[index], remaining - 1
        if filled >= bucket_size:
            closed, filled = closed + _round_up(filled, divisor), 0
            state = (total - remaining) % n
            if state in seen:  # the same state again: the buckets since then repeat
                used, added = seen[state][0] - remaining, closed - seen[state][1]
                cycles = remaining // used
                remaining, closed = remaining - cycles * used, closed + cycles * added
            seen[state] = (remaining, closed)
    return closed, filled


@dataclass(frozen=True)
class StateBytes:
    """Bytes of weights, gradients and optimizer state on one rank."""

    weights: int
    gradients: int
    optimizer: int


def planned_state_bytes(model: ModelConfig, vocab_size: int, layout: Layout, *, bf16: bool,
                        distributed_optimizer: bool, stage: int = 0) -> StateBytes:
    """The planned :class:`StateBytes` of the busiest data-parallel rank of one tensor-parallel rank of ``stage``.

    The distributed optimizer gives each data x context-parallel rank one equal shard of the padded
    buffer and keeps state for the parameter elements in it: the busiest rank is planned at a whole
    shard, or at every parameter when the buffer holds less than one shard of them. That is exact
    unless every rank's shard holds some of Megatron's padding (under 64 elements per parameter)."""
    groups = parameter_groups(model, vocab_size, layout.tensor, layout.pipeline, stage)
    parameters = sum(sum(pattern) * repeats for pattern, repeats in groups)
    shards = layout.data * layout.context  # the distributed optimizer shards over data x context ranks
    padded = _padded_buffer_elements(groups, shards) if distributed_optimizer else parameters
    owned = min(padded // shards, parameters) if distributed_optimizer else parameters
    per_element = 8 + (4 if bf16 else 0)  # Adam's fp32 moments (+ fp32 master of a bf16 parameter)
    return StateBytes(padded * (2 if bf16 else 4), padded * 4, owned * per_element)


def state_bytes(engine) -> StateBytes:
    """This rank's measured weight, gradient and optimizer bytes in a live :class:`Engine`."""
    buffers = list(engine.model.buffers) + list(getattr(engine.model, "expert_parallel_buffers", []))
    param_buffers = [b.param_data for b in buffers if b.param_data is not None]
    if param_buffers:
        weights = sum(t.numel() * t.element_size() for t in param_buffers)
    else:
        weights = sum(p.numel() * p.element_size() for p in engine.gpt.parameters())
    gradients = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    seen, optimizer = set(), 0
    model_storages = {p.untyped_storage().data_ptr() for p in engine.gpt.parameters()}
    model_storages |= {t.untyped_storage().data_ptr() for t in param_buffers}

    def count(tensor: torch.Tensor) -> None:
        nonlocal optimizer
        storage = tensor.untyped_storage()
        if tensor.dim() and storage.data_ptr() not in seen and storage.data_ptr() not in model_storages:
            seen.add(storage.data_ptr())
            optimizer += storage.nbytes()

    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for state in opt.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    count(value)
        for group in opt.optimizer.param_groups:  # fp32 masters (views of the parameters in fp32 runs)
            for param in group["params"]:
                count(param)
    return StateBytes(weights, gradients, optimizer)


@dataclass(frozen=True)
class CheckpointPeak:
    """Host memory one process needs on top of training while it saves or loads a checkpoint, or
    reads ``model.init_from_hf`` (the busiest rank; device memory grows by nothing: every tensor
    handed to dist_checkpointing is a view of the training state, and loads fill it in place)."""

    # what the rank writes: dist_checkpointing stages it in host memory (a device-to-host copy on GPUs,
    # forked writer processes on the CPU), not in the training process's device memory
    save: int
    load: int  # PyTorch DCP reads one stored chunk's bytes at a time, deserialises and copies them into place
    # the pages of its slices safetensors maps in (fp32 files at worst), and one tensor's slice read
    # and joined (QKV, gate/up)
    init_from_hf: int


def checkpoint_peak(model: ModelConfig, vocab_size: int, layout: Layout, *, bf16: bool,
                    distributed_optimizer: bool) -> CheckpointPeak:
    """The :class:`CheckpointPeak` of the rank that writes most: data-parallel rank 0 of tensor rank 0
    writes its stage's weights (one replica) and its slice of the optimizer state (model space,
    :mod:`nemo_anchor.training.optimizer_state`); fp32 masters only for bf16 parameters.

    Loading is planned for a checkpoint saved in the same layout (stored chunks as large as this
    rank's tensors, in fp32); one saved with less tensor parallelism has larger chunks.
    """
    written = largest = stage_params = 0
    for stage in {0, layout.pipeline - 1, min(1, layout.pipeline - 1)}:  # every middle stage holds the same
        groups = parameter_groups(model, vocab_size, layout.tensor, layout.pipeline, stage)
        parameters = sum(sum(pattern) * repeats for pattern, repeats in groups)
        optimizer = planned_state_bytes(model, vocab_size, layout, bf16=bf16, stage=stage,
                                        distributed_optimizer=distributed_optimizer).optimizer
        written = max(written, parameters * (2 if bf16 else 4) + optimizer)
        largest = max(largest, max(max(pattern) for pattern, _ in groups))
        stage_params = max(stage_params, parameters)
    return CheckpointPeak(save=written, load=2 * 4 * largest, init_from_hf=4 * stage_params + 2 * 4 * largest)


def activation_bytes_per_token(model: ModelConfig, vocab_size: int, *, bf16: bool, tensor: int = 1,
                               fusions: bool = False) -> dict:
    """Bytes autograd saves per token of a micro-batch (one tensor-parallel rank, sequence parallel):
    per transformer layer, per recomputed layer (its input), and for the final norm, logits and loss.

    Counted from what this model saves (checked with autograd's saved-tensor hooks in the tests):
    each RMSNorm its input, its normalised input and output (3h) and an fp32 rstd; the fused QKV
    output, q and k after RoPE (fp32 cos/sin per token), the attention output and fp32 log-sum-exp
    (kernels keep no T x T scores); fc1's output and SwiGLU's three ffn-sized tensors.

    ``fusions``: Megatron's bias-SwiGLU fusion saves only fc1's output (2 ffn; fc2 keeps its input, 1
    ffn) instead of the unfused 5 ffn; its fused cross entropy (Transformer Engine's, in place on the
    logits) keeps the logits in the training dtype without the fp32 copy the unfused one makes in bf16.
    """
    a = 2 if bf16 else 4
    h, d, ffn, heads = model.hidden_size, model.kv_channels, model.ffn_hidden_size, model.num_attention_heads
    q, kv = heads * d, model.num_query_groups * d
    swiglu = 3 * ffn if fusions else 5 * ffn
    layer = (6 * h + 3 * q + 3 * kv + swiglu) * a / tensor + 4 * 4 * d + 4 * heads / tensor + 8
    # final norm; logits, and (unfused, in bf16) the cross entropy's fp32 copy of them
    logits = (3 * h * a + 4) / tensor + vocab_size / tensor * (a if fusions else 4 + (a if bf16 else 0))
    return {"layer": layer, "layer_input": h * a / tensor, "logits": logits}


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU bytes of the busiest rank, and the verdict against the GPU."""

    weights: int
    gradients: int
    optimizer: int
    activations: int  # saved by the forward pass of the micro-batches in flight
    recompute_workspace: int  # one recomputed layer's activations, rebuilt during backward
    logits: int
    communication: int
    reserved: int
    total: int
    gpu_bytes: int  # what PyTorch can allocate on the GPU
    layout: Layout
    kv_extra: int = 0  # of the activations: the gathered K/V (all_gather CP) kept for backward
    headroom: int = 0  # left free for the allocator (ALLOCATOR_HEADROOM of gpu_bytes)

    @property
    def fits(self) -> bool:
        return self.total + self.headroom <= self.gpu_bytes

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "layout"}
        return {**out, "layout": asdict(self.layout), "fits": self.fits,
                **{f"{k}_gib": round(v / GIB, 2) for k, v in out.items()}}


def plan_memory(model: ModelConfig, vocab_size: int, layout: Layout, *, gpu_bytes: int, micro_batch_size: int,
                bf16: bool = True, distributed_optimizer: bool = True, reserved: int = _CUDA_CONTEXT_BYTES,
                fusions: bool = False) -> MemoryPlan:
    """The busiest rank's memory for ``model`` trained on ``layout`` (the first pipeline stage holds
    the most micro-batches in flight, the last the logits: both are taken at their worst)."""
    state = _busiest_state(model, vocab_size, layout, bf16=bf16, distributed_optimizer=distributed_optimizer)
    tokens = model.seq_length * micro_batch_size // layout.context
    per_token = activation_bytes_per_token(model, vocab_size, bf16=bf16, tensor=layout.tensor, fusions=fusions)
    a, kv = (2 if bf16 else 4), model.num_query_groups * model.kv_channels
    kv_row = 2 * kv * a / layout.tensor  # one token's keys and values
    gathered = layout.context > 1 and model.cp_comm_type == "all_gather"
    window_tokens = model.seq_length * micro_batch_size
    # per layer kept for the backward: the all_gather K/V of the whole window
    kv_extra_per_layer = window_tokens * kv_row if gathered else 0
    layers = model.num_layers // layout.pipeline
    recomputed = 0 if model.recompute != "full" else (model.recompute_num_layers or layers)
    # selective recompute (core attention) frees nothing measurable here: attention kernels keep only
    # q, k, v, the output and the log-sum-exp, which the recompute needs anyway
    stored = (layers - recomputed) * per_token["layer"] + recomputed * per_token["layer_input"]
    in_flight = layout.pipeline  # 1F1B: the first stage holds up to `pipeline` micro-batches
    kv_extra = int((layers - recomputed) * kv_extra_per_layer * in_flight)
    activations = int(tokens * stored * in_flight) + kv_extra
    # one layer, rebuilt in backward
    recompute_workspace = int(tokens * per_token["layer"] + kv_extra_per_layer) if recomputed else 0
    logits = int(tokens * per_token["logits"])
    a2a = layout.context > 1 and not gathered  # one layer's all-to-all of K/V in flight
    communication = int(tokens * model.hidden_size * a * (layout.tensor > 1) + window_tokens * kv_row * a2a)
    total = (state.weights + state.gradients + state.optimizer + activations + recompute_workspace + logits
             + communication + reserved)
    return MemoryPlan(state.weights, state.gradients, state.optimizer, activations, recompute_workspace, logits,
                      communication, reserved, total, gpu_bytes, layout, kv_extra=kv_extra,
                      headroom=int(gpu_bytes * ALLOCATOR_HEADROOM))


def _busiest_state(model: ModelConfig, vocab_size: int, layout: Layout, **options) -> StateBytes:
    """The largest weights + gradients + optimizer state of any pipeline stage: the first (embedding),
    the last (output layer) and, as every middle stage holds the same layers, one middle stage."""
    stages = {0, layout.pipeline - 1, min(1, layout.pipeline - 1)}
    return max((planned_state_bytes(model, vocab_size, layout, stage=stage, **options) for stage in stages),
               key=lambda b: b.weights + b.gradients + b.optimizer)


def fewest_recomputed_layers(model: ModelConfig, vocab_size: int, layout: Layout, **options) -> int | None:
    """The fewest layers per stage that full recompute must cover for ``model`` to fit ``layout``, or
    None when recomputing all of them is not enough. Solved in closed form: each recomputed layer saves
    the same bytes."""
    def plan(layers: int) -> MemoryPlan:
        return plan_memory(replace(model, recompute="full", recompute_num_layers=layers), vocab_size, layout, **options)

    per_stage = model.num_layers // layout.pipeline
    one, every = plan(1), plan(per_stage)
    if not every.fits:
        return None
    saved_per_layer = (one.total - every.total) / max(per_stage - 1, 1)
    over = one.total + one.headroom - one.gpu_bytes  # what one recomputed layer leaves over the GPU
    layers = 1 if one.fits else min(per_stage, 1 + math.ceil(over / saved_per_layer))
    while not plan(layers).fits:  # int() rounding of the byte counts can leave it one layer short
        layers += 1
    return layers


_GPU_FACTORS = (1, 2, 4, 8, 16, 32, 64)
_TENSOR_SIZES = (1, 2, 4, 8)  # tensor parallelism stays inside one 8-GPU node


def suggest(model: ModelConfig, vocab_size: int, layout: Layout, *, gpu_bytes: int, micro_batch_size: int,
            bf16: bool, distributed_optimizer: bool, fusions: bool = False) -> str | None:
    """The smallest change that makes a plan that does not fit fit, in the order users try them: full
    recompute of the fewest layers; then, on the same GPUs and up to 64x as many, every tensor x
    context parallel layout the model allows, first as it is, then with the fewest recomputed layers."""
    options = dict(gpu_bytes=gpu_bytes, micro_batch_size=micro_batch_size, bf16=bf16,
                   distributed_optimizer=distributed_optimizer, fusions=fusions)
    if model.recompute != "full" or model.recompute_num_layers is not None:
        layers = fewest_recomputed_layers(model, vocab_size, layout, **options)
        if layers is not None and (model.recompute != "full" or layers > model.recompute_num_layers):
            return f"model.recompute=full model.recompute_num_layers={layers}"
    for factor in _GPU_FACTORS:
        for candidate, bigger in _layouts(model, layout, layout.gpus * factor):
            if plan_memory(candidate, vocab_size, bigger, **options).fits:
                return _describe(layout, bigger)
            layers = fewest_recomputed_layers(candidate, vocab_size, bigger, **options)
            if layers is not None:
                return _describe(layout, bigger, f"model.recompute=full model.recompute_num_layers={layers}")
    return None


def _describe(layout: Layout, bigger: Layout, *more: str) -> str:
    """The overrides that turn ``layout`` into ``bigger``, after the GPU count when it grows."""
    change = [f"model.tensor_model_parallel_size={bigger.tensor}"] * (bigger.tensor != layout.tensor)
    change += [f"model.context_parallel_size={bigger.context}"] * (bigger.context != layout.context)
    change += more
    if bigger.gpus == layout.gpus:
        return " ".join(change)
    return f"{bigger.gpus} GPUs" + (f" with {' '.join(change)}" if change else f" (data parallel {bigger.data})")


def _layouts(model: ModelConfig, layout: Layout, gpus: int):
    """(model, layout) of every other tensor x context parallel split of ``gpus`` the model allows,
    fewest tensor-parallel ranks first, then fewest context-parallel ranks."""
    for tensor in _TENSOR_SIZES:
        context = 1
        while tensor * layout.pipeline * context <= gpus:
            bigger = replace(layout, gpus=gpus, tensor=tensor, context=context)
            if (bigger != layout and gpus % (tensor * layout.pipeline * context) == 0
                    and model.seq_length % (2 * context) == 0):
                try:
                    yield replace(model, tensor_model_parallel_size=tensor, context_parallel_size=context), bigger
                except ValueError:  # the heads do not split over these ranks
                    pass
            context *= 2


def saved_activation_bytes(model: torch.nn.Module, run) -> int:
    """Bytes of the distinct tensors autograd saves for backward while ``run()`` executes a forward
    pass (parameters excluded): what the activation estimate predicts."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.device.type != "meta":
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(storages.values())
