"""One rule for every import of weights: the source's tensors and the target's are the same set, shape for shape.

Every tensor the target model needs must come from the source, and every tensor of the source
must be used; otherwise the import is refused naming the tensor, both shapes and the config key
that decides it (``explain``). Used by ``import-hf``, ``model.init_from_hf``, ``eval``/``probe``
of Hugging Face directories, and the NeMo importers.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

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
