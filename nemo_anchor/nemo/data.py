"""NeMo data module over ``nemo-anchor pack`` output: packed windows with their document structure.

Each micro-batch is ``nemo_anchor.data.collate_windows`` of B windows: ``tokens``, ``labels``,
``loss_mask``, ``position_ids`` ``[B, T]`` plus ``cu_seqlens`` (document boundaries) and
``cu_windows`` (window boundaries) over the flattened B*T tokens. The anchor configs' data and
forward steps (``nemo_anchor.nemo.config``) turn them into ``AnchorPackedSeqParams``: NeMo's
``PackedSeqParams`` path with the anchor metadata the core attention needs.

Data-parallel sharding is NeMo's: ``MegatronDataSampler`` replaces the loader's sampler when the
trainer sets the module up. Resumption is NeMo's too: the module's ``state_dict`` (saved in every
checkpoint) holds the windows consumed so far, and a resumed run continues the stream from there,
as NeMo's own ``PreTrainingDataModule`` does.
"""

from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer
from nemo.lightning.pytorch.plugins import MegatronDataSampler

from nemo_anchor.data import PackedDataset, collate_windows


class AnchorPackedDataModule(pl.LightningDataModule):
    """Args:
        path: a packed dataset directory (``nemo-anchor pack --output``); its ``tokenizer/`` is the tokenizer.
        seq_length: the window length T; must equal the dataset's.
        micro_batch_size, global_batch_size, rampup_batch_size: as in NeMo's data modules.
        valid_path: an optional held-out packed dataset (``pack --valid-fraction`` writes ``path/valid``).
        num_workers: DataLoader workers.
    """

    def __init__(self, path: str, seq_length: int, micro_batch_size: int = 1, global_batch_size: int = 8,
                 rampup_batch_size: Optional[List[int]] = None, valid_path: Optional[str] = None,
                 num_workers: int = 2):
        super().__init__()
        self.path, self.valid_path = path, valid_path
        self.seq_length = seq_length
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.num_workers = num_workers
        self.init_global_step = 0
        train = self._open(path)
        self.tokenizer = AutoTokenizer(str(train.tokenizer_path))
        self.data_sampler = MegatronDataSampler(seq_len=seq_length, micro_batch_size=micro_batch_size,
                                                global_batch_size=global_batch_size,
                                                rampup_batch_size=rampup_batch_size)

    def _open(self, path: str) -> PackedDataset:
        dataset = PackedDataset(path)
        if dataset.seq_length != self.seq_length:
            raise ValueError(f"seq_length={self.seq_length} but the packed dataset {path} has windows of "
                             f"{dataset.seq_length} tokens: repack it or change seq_length")
        return dataset

    def setup(self, stage: str = "") -> None:
        self._train_ds = self._open(self.path)
        self._valid_ds = self._open(self.valid_path) if self.valid_path else None

    @property
    def train_dataset(self) -> PackedDataset:
        if not hasattr(self, "_train_ds"):
            self.setup()
        return self._train_ds

    def train_dataloader(self) -> DataLoader:
        if not hasattr(self, "_train_ds"):
            self.setup()
        return self._loader(self._train_ds)

    def val_dataloader(self) -> DataLoader | list:
        if not hasattr(self, "_train_ds"):
            self.setup()
        return [] if self._valid_ds is None else self._loader(self._valid_ds)

    def _loader(self, dataset: PackedDataset) -> DataLoader:
        self.init_global_step = self.trainer.global_step if self.trainer is not None else 0
        self.data_sampler.init_global_step = self.init_global_step
        return DataLoader(dataset, batch_size=self.micro_batch_size, num_workers=self.num_workers,
                          collate_fn=collate_windows, persistent_workers=self.num_workers > 0)

    def state_dict(self) -> Dict[str, Any]:
        """Saved with each checkpoint: the windows (samples) the run has consumed."""
        steps = self.trainer.global_step - self.init_global_step
        return {"consumed_samples": self.data_sampler.compute_consumed_samples(steps)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """On resume: continue the window stream after the consumed windows (NeMo's ``MegatronDataSampler``)."""
        from megatron.core.num_microbatches_calculator import update_num_microbatches

        consumed = state_dict["consumed_samples"]
        self.data_sampler.init_consumed_samples = consumed
        self.data_sampler.prev_consumed_samples = consumed
        update_num_microbatches(consumed_samples=consumed, consistency_check=False)
        self.data_sampler.if_first_step = 1

    def reconfigure_limit_batches(self) -> None:
        """Count ``limit_*_batches`` in micro-batches, as NeMo's own data modules do; no validation without ``valid_path``."""
        from nemo.collections.llm.gpt.data.utils import _reconfigure_limit_batches

        self.trainer.limit_train_batches = _reconfigure_limit_batches(self.trainer.limit_train_batches, self.train_dataset)
        if self._valid_ds is None:
            self.trainer.limit_val_batches = 0
        else:
            self.trainer.limit_val_batches = _reconfigure_limit_batches(self.trainer.limit_val_batches, self._valid_ds)
