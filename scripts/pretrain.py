"""torchrun entry point: ``torchrun --nproc_per_node N scripts/pretrain.py --config FILE [key=value ...]``.

The same as ``nemo-anchor train``; kept as a script because NeMo/Megatron users launch scripts.
"""
import sys

from nemo_anchor.training.cli import main

if __name__ == "__main__":  # dist_checkpointing's spawn-context workers re-import this module
    sys.exit(main())
