"""The optimizer's state as sharded tensors in model space: a checkpoint any parallel layout can resume.

Megatron's non-distributed optimizers describe their state with the model's own sharded state
dict (``optimizer.state.exp_avg.model.decoder.layers...`` and, for bf16 parameters,
``optimizer.state.fp32_param...``), so a checkpoint of theirs loads under any tensor, pipeline,
context or data split. The distributed optimizer in Megatron-Core 0.16.1 offers that *model
space* format only through ``fully_sharded_model_space``, which builds ShardedTensors with a
``flattened_range`` that this version's dist_checkpointing refuses ("flattened_range is not
supported"); its ``fully_reshardable`` format gathers three full fp32 buffers on a rank, and
``dp_reshardable`` reshards across data parallelism only.

So the distributed optimizer's state is written here under the very keys and geometry the
non-distributed optimizers use. Each data x context-parallel rank owns a contiguous range of the
flattened parameter (DDP's buffer layout); that range is cut into at most a few N-D boxes and each
box becomes a ShardedTensor (uneven sharding, which dist_checkpointing hands to PyTorch DCP). The
data are views of the optimizer's own tensors (``get_parameter_state_dp_reshardable``): nothing
is gathered or copied on a rank, and loading writes into the live state.

It is also the one place that makes the distributed optimizer reload exactly over torch's Adam, which
Megatron-Core runs where neither Apex's nor Transformer Engine's Adam imports (``HAVE_APEX_OR_TE``
False: the CPU, or a GPU without them). Every front door calls it: :func:`prepare_load` (ours),
:func:`create_state_for_load` and :func:`give_each_parameter_its_adam_step` (NeMo's strategy, Bridge's
checkpoint manager).
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from nemo_anchor.convert.megatron_state import MAIN_PARAM, STATE_PREFIX


def optimizers(optimizer) -> list:
    """The optimizers inside Megatron's ``ChainedOptimizer`` (or ``[optimizer]``)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_distributed(optimizer) -> bool:
    return any(isinstance(opt, DistributedOptimizer) for opt in optimizers(optimizer))


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offset, size)`` N-D boxes that together hold elements ``[start, end)`` of a row-major
    tensor of ``shape``, in order; each box is one contiguous run of the flattened tensor."""
    if start >= end:
        return []
    if len(shape) == 1:
        return [((start,), (end - start,))]
    row = math.prod(shape[1:])
    first_full, end_full = -(-start // row), end // row
    if first_full > end_full:  # inside one row
        r = start // row
        return [((r, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], start - r * row, end - r * row)]
    boxes = []
    if start < first_full * row:  # the tail of the row before the first full one
        r = first_full - 1
        boxes += [((r, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], start - r * row, row)]
    if end_full > first_full:
        boxes.append(((first_full, *[0] * (len(shape) - 1)), (end_full - first_full, *shape[1:])))
    if end > end_full * row:  # the head of the row after the last full one
        boxes += [((end_full, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, end - end_full * row)]
    return boxes


def parts(sharded) -> list[ShardedTensor]:
    """The ShardedTensors a model entry stands for (a factory such as SwiGLU's fc1 builds several)."""
    if isinstance(sharded, ShardedTensorFactory):
        built = sharded.build()
        return list(built) if isinstance(built, (list, tuple)) else [built]
    return [sharded]


def _boxes_of_range(sharded, param: torch.Tensor, start: int, end: int, key: str, data: torch.Tensor,
                    replica_id) -> Iterator[ShardedTensor]:
    """ShardedTensors under ``key`` for elements ``[start, end)`` of ``param`` (held in ``data``, a
    flat tensor of ``end - start`` elements), placed where the model's sharded entry puts them."""
    for part in parts(sharded):
        if not part.data.is_contiguous():
            raise ValueError(f"{part.key}: a non-contiguous model shard cannot be mapped to its optimizer state")
        part_start = part.data.storage_offset() - param.storage_offset()
        lo, hi = max(start, part_start), min(end, part_start + part.data.numel())
        axes = part.prepend_axis_num
        cursor = lo - start
        for offset, size in flat_range_boxes(tuple(part.local_shape), lo - part_start, hi - part_start):
            count = math.prod(size)
            global_offset = (*part.global_offset[:axes],
                             *(g + o for g, o in zip(part.global_offset[axes:], offset)))
            local_shape = (1,) * axes + tuple(size)  # the layer axis stays explicit: uneven shards have no prepended axes
            yield ShardedTensor(key=key, data=data[cursor:cursor + count].view(local_shape), dtype=data.dtype,
                                local_shape=local_shape, global_shape=tuple(part.global_shape),
                                global_offset=global_offset, axis_fragmentations=None, replica_id=replica_id)
            cursor += count


def _owned_states(opt: DistributedOptimizer) -> Iterator[tuple[torch.nn.Parameter, range, dict]]:
    """(model parameter, the flat range of it this rank owns, its live main-param and Adam tensors)."""
    state = opt.get_parameter_state_dp_reshardable()  # views of the optimizer's tensors, no copies
    for gbuf_index, by_dtype in enumerate(opt.gbuf_ranges):
        for dtype, buckets in by_dtype.items():
            for bucket, bucket_state in zip(buckets, state[gbuf_index][dtype]):
                for (param, ranges), tensors in zip(bucket["param_map"].items(), bucket_state):
                    owned = ranges["param"]
                    yield param, range(owned.start, owned.end), tensors


def distributed_param_state(opt: DistributedOptimizer, model_sharded: dict) -> list[ShardedTensor]:
    """This rank's slice of ``opt``'s parameter state as model-space ShardedTensors (views).

    ``model_sharded`` is the model's ``sharded_state_dict()``; keys are
    ``optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<model key>``. fp32 parameters are their own
    masters (the model entry holds them), so only bf16 parameters get an ``fp32_param`` entry.
    """
    by_param = {id(value.data): value for value in model_sharded.values()
                if isinstance(value, (ShardedTensor, ShardedTensorFactory))}
    instance = opt.distributed_optimizer_instance_id
    tensors = []
    for param, owned, state in _owned_states(opt):
        sharded = by_param.get(id(param))
        if sharded is None:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} is missing from the model's sharded state dict")
        replica_id = (*sharded.replica_id[:2], instance)  # every data-parallel rank owns a distinct range
        for name, value in state.items():
            if not torch.is_tensor(value) or value.dim() != 1 or (name == "param" and param.dtype == torch.float32):
                continue  # Adam's step (in the param groups), and fp32 masters that are the parameters
            name = MAIN_PARAM if name == "param" else name
            tensors += _boxes_of_range(sharded, param, owned.start, owned.stop,
                                       f"{STATE_PREFIX}.{name}.{sharded.key}", value, replica_id)
    return tensors


def sharded_state(optimizer, model_sharded: dict, *, is_loading: bool) -> dict:
    """The whole optimizer (every optimizer of a chain) as a sharded state dict in model space.

    A distributed optimizer: its ``state_dict()`` (param groups with Adam's step, grad scaler) and
    :func:`distributed_param_state`. Any other Megatron optimizer: its own ``sharded_state_dict``.
    For loading, call :func:`prepare_load` first so that the distributed optimizer's state exists.
    """
    state = {}
    for index, opt in enumerate(optimizers(optimizer)):
        if isinstance(opt, DistributedOptimizer):
            state[index] = {"groups": opt.state_dict(), "params": distributed_param_state(opt, model_sharded)}
        else:
            state[index] = {"megatron": opt.sharded_state_dict(model_sharded, is_loading=is_loading)}
    return state


def prepare_load(optimizer, common: dict) -> None:
    """Give each distributed optimizer the saved param groups (and Adam's step) from the checkpoint's
    common state; this allocates the Adam tensors the sharded load then fills in place."""
    for index, opt in enumerate(optimizers(optimizer)):
        if isinstance(opt, DistributedOptimizer):
            opt.load_state_dict(common[index]["groups"])
    give_each_parameter_its_adam_step(optimizer)


def torch_adam() -> bool:
    """Whether Megatron-Core's distributed optimizer runs torch's Adam here (no Apex or TE Adam)."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def create_state_for_load(optimizer) -> None:
    """Create the Adam state of each distributed optimizer over torch's Adam that has none yet, before a load.

    Megatron-Core (0.16.1 and 0.19.2) builds the state to load into from the live one:
    ``DistributedOptimizer.sharded_state_dict(is_loading=True)`` calls ``state_dict()``, which reads
    torch Adam's ``step`` from every parameter's state (``distrib_optimizer.py:837`` in 0.19.2) and
    asserts on a state that is empty until the first step. The state is created first with Megatron's
    own ``_init_optimizer_states_with_dummy_values`` (one step on zero gradients, as Megatron-LM does
    before a load); the load then replaces every value, the parameters' included.
    """
    if not torch_adam():
        return
    for opt in optimizers(optimizer):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def give_each_parameter_its_adam_step(optimizer, step: int | None = None) -> None:
    """After a load into torch's Adam: each parameter its own ``step`` tensor, holding the restored count.

    ``DistributedOptimizer.load_state_dict`` over torch's Adam gives every parameter one shared
    ``step`` tensor (``distrib_optimizer.py:1025-1032`` in 0.19.2); Adam increments each parameter's
    step in place, so the shared count would advance once per parameter per step. And a sharded load
    keeps the count of the placeholder state :func:`create_state_for_load` made (1), while the
    checkpoint's count is in each param group's ``step``, where Megatron records it for torch's Adam
    (``distrib_optimizer.py:869-871``): the bias correction of every step after the resume would be
    wrong. ``step``: the count to set instead (NeMo's restored global step).
    """
    for opt in optimizers(optimizer):
        if not isinstance(opt, DistributedOptimizer):
            continue
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                state = opt.optimizer.state.get(param, {})
                if torch.is_tensor(state.get("step")):
                    count = step if step is not None else group.get("step", state["step"].item())
                    state["step"] = torch.tensor(float(count), dtype=state["step"].dtype)


def load_targets(optimizer, sharded: dict) -> dict[int, list[torch.Tensor]]:
    """The live tensors (views) the distributed optimizers' entries of ``sharded`` load into."""
    return {index: [tensor.data for tensor in sharded[index]["params"]]
            for index, opt in enumerate(optimizers(optimizer)) if isinstance(opt, DistributedOptimizer)}


def finish_load(optimizer, loaded: dict, targets: dict[int, list[torch.Tensor]]) -> None:
    """Put loaded values into the optimizers: into the live state of distributed optimizers (a copy
    onto itself where dist_checkpointing loaded in place), through ``load_state_dict`` otherwise."""
    for index, opt in enumerate(optimizers(optimizer)):
        if isinstance(opt, DistributedOptimizer):
            with torch.no_grad():
                for target, value in zip(targets[index], loaded[index]["params"]):
                    target.copy_(value)
        else:
            opt.load_state_dict(loaded[index]["megatron"])
