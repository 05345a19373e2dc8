"""One rule for every import of weights: the source's tensors and the target's are the same set, shape for shape.

Every tensor the target model needs must come from the source, and every tensor of the source
must be used; otherwise the import is refused naming the tensor, both shapes and the config key
that decides it (``explain``). Used by ``import-hf``, ``model.init_from_hf``, ``eval``/``probe``
of Hugging Face directories, and the NeMo importers.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

Shape = tuple[int, ...]
# (tensor name, axis that differs or None for a missing/unused tensor) -> the config key deciding it, e.g.
# "config.json num_hidden_layers=3"
Explain = Callable[[str, Optional[int]], str]


def match_weights(found: Mapping[str, Shape], expected: Mapping[str, Shape], *, source: str,
                  explain: Explain) -> None:
    """ValueError unless ``found`` (the source's tensors) and ``expected`` (the target's) match.

    The message names the first mismatched, then missing, then unused tensor, with both shapes
    and ``explain(name, axis)``, and how many tensors disagree in all.
    """
    mismatched = [name for name in expected if name in found and tuple(found[name]) != tuple(expected[name])]
    missing = [name for name in expected if name not in found]
    unused = [name for name in found if name not in expected]
    count = len(mismatched) + len(missing) + len(unused)
    if not count:
        return
    more = f" ({count} tensors disagree in all)" if count > 1 else ""
    if mismatched:
        name = mismatched[0]
        have, want = tuple(found[name]), tuple(expected[name])
        axis = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), None) if len(have) == len(want) \
            else None
        raise ValueError(f"{source}: tensor {name} has shape {have} in the weights, but {explain(name, axis)} "
                         f"makes it {want}{more}")
    if missing:
        name = missing[0]
        raise ValueError(f"{source}: the weights lack tensor {name} of shape {tuple(expected[name])}, which "
                         f"{explain(name, None)} needs{more}")
    name = unused[0]
    raise ValueError(f"{source}: tensor {name} of shape {tuple(found[name])} in the weights is not used by "
                     f"{explain(name, None)}{more}")


def config_key_explainer(where: str, axis_keys: Mapping[str, Sequence[str]], values: Mapping[str, object], *,
                         is_layer: Callable[[str], object], layers: str, head: str, tied: str,
                         fallback: str) -> Explain:
    """An :data:`Explain` for one naming scheme: ``axis_keys`` maps a module-name suffix to the config key of
    each axis of its tensors, ``values`` each key to its value; a missing or unused tensor of a layer
    (``is_layer``) is down to the layer count (``layers``), the output layer ``head`` to ``tied``."""

    def explain(name: str, axis: Optional[int]) -> str:
        if axis is None and is_layer(name):
            return f"{where} ({layers})"
        if axis is None and name == head:
            return f"{where} ({tied})"
        module = name.rsplit(".", 2)[-2]
        keys = next((keys for part, keys in axis_keys.items() if module.endswith(part)), ())
        if axis is None or axis >= len(keys):
            return f"{where} ({fallback})"
        return f"{where} ({keys[axis]}={values[keys[axis]]})"

    return explain
