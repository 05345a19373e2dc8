"""A Hugging Face checkpoint's weights in canonical Megatron form, read slice by slice from safetensors.

``model.init_from_hf`` on a multi-GPU run must not load the whole model on every process: each
rank needs only its tensor- and pipeline-parallel shard. :func:`sliced_state` returns the
canonical state (:mod:`nemo_anchor.convert.megatron_state`) as lazy tensors whose ``[rows, cols]``
indexing reads just those rows and columns from the files (``safe_open(...).get_slice``), so
:func:`~nemo_anchor.convert.megatron_state.load_into_model` copies each rank's slice without the
rest ever being read.

Which HF rows make up each canonical tensor (the QKV interleaving per query group, gate and up
stacked in ``linear_fc1``) is not restated here: :func:`~nemo_anchor.convert.hf_mapping.hf_to_megatron_state`
is run on *row numbers* instead of weights, and its output says, row by row, where to read.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from nemo_anchor.convert.hf_mapping import hf_to_megatron_state
from nemo_anchor.model.config import ModelConfig


class _SlicedTensor:
    """A canonical tensor made of rows of HF tensors; indexing reads only the rows and columns asked for."""

    def __init__(self, files: "_SafetensorsDir", rows: torch.Tensor, tail: tuple[int, ...]):
        self._files, self._rows, self.shape = files, rows, (len(rows), *tail)

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        rows, columns = self._rows[index[0]], index[1:]
        tensors = self._files.tensor_of(rows)
        breaks = torch.nonzero((rows.diff() != 1) | (tensors.diff() != 0)).flatten() + 1
        pieces, start = [], 0
        for end in [*breaks.tolist(), len(rows)]:  # runs of consecutive rows of one HF tensor
            name, first = self._files.locate(int(rows[start]))
            pieces.append(self._files.slice(name)[(slice(first, first + end - start), *columns)])
            start = end
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class _SafetensorsDir:
    """The tensors of a directory's ``*.safetensors`` files, opened lazily, every row numbered globally."""

    def __init__(self, path: Path, stack: contextlib.ExitStack):
        from safetensors import safe_open

        self.shapes: dict[str, tuple[int, ...]] = {}
        self._handles = {}
        for file in sorted(path.glob("*.safetensors")):
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            for name in handle.keys():
                self._handles[name] = handle
                self.shapes[name] = tuple(handle.get_slice(name).get_shape())
        self.names = sorted(self.shapes)
        self._starts = torch.tensor([0, *[self.shapes[n][0] for n in self.names]]).cumsum(0)

    def row_numbers(self) -> dict[str, torch.Tensor]:
        """Each tensor as the global numbers of its rows (1-D, the length of its first dimension)."""
        return {name: torch.arange(int(self._starts[i]), int(self._starts[i + 1])) for i, name in enumerate(self.names)}

    def tensor_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The index into ``names`` of the tensor each global row number belongs to."""
        return torch.searchsorted(self._starts, rows, right=True) - 1

    def locate(self, row: int) -> tuple[str, int]:
        """(tensor name, row within it) of global row number ``row``."""
        i = int(self.tensor_of(torch.tensor(row)))
        return self.names[i], row - int(self._starts[i])

    def slice(self, name: str):
        return self._handles[name].get_slice(name)


@contextlib.contextmanager
def sliced_state(path: str | Path, cfg: ModelConfig):
    """Context manager: the canonical Megatron state of the HF directory ``path`` as lazy tensors
    (files stay open inside the ``with``); ValueError naming a missing HF tensor."""
    with contextlib.ExitStack() as stack:
        files = _SafetensorsDir(Path(path), stack)
        rows = hf_to_megatron_state(files.row_numbers(), cfg, source=str(path))
        tails = {}
        for canonical, numbers in rows.items():
            sources = [files.names[i] for i in files.tensor_of(numbers).unique().tolist()]
            shapes = {files.shapes[name][1:] for name in sources}
            if len(shapes) > 1:
                raise ValueError(f"{path}: {sources} make up {canonical} but differ in shape beyond their first "
                                 f"dimension ({sorted(shapes)})")
            tails[canonical] = shapes.pop()
        yield {canonical: _SlicedTensor(files, numbers, tails[canonical]) for canonical, numbers in rows.items()}


def has_safetensors(path: str | Path) -> bool:
    return any(Path(path).glob("*.safetensors"))
