"""The smallest real training run, shared by the robustness tests: a 1-layer model on 64-token byte windows."""
import json

import yaml

from nemo_anchor.cli import main
from nemo_anchor.data import PackOptions, pack

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 6, "Pack my box with five dozen liquor jugs! " * 4] * 8


def pack_texts(root, texts=TEXTS, tokenizer: str = "byte", name: str = "byte"):
    """``texts`` as ``root/corpus.jsonl``, packed with ``tokenizer`` into ``root/name``; returns that directory."""
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pack([corpus], tokenizer, root / name, PackOptions(seq_length=64))
    return root / name


def write_tiny_config(output_dir, data_path, max_steps: int = 4):
    """The tiny run's config file, beside ``output_dir``; returns its path."""
    config = {
        "output_dir": str(output_dir),
        "model": {"num_layers": 1, "hidden_size": 16, "ffn_hidden_size": 32, "num_attention_heads": 2,
                  "num_query_groups": 1, "seq_length": 64},
        "data": {"path": str(data_path)},
        "trainer": {"max_steps": max_steps, "global_batch_size": 1, "micro_batch_size": 1, "precision": "fp32",
                    "progress_bar": False},
        "checkpoint": {"save_every": 2, "keep_last": 2},
    }
    path = output_dir.parent / f"{output_dir.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train_tiny(output_dir, data_path, *overrides, max_steps: int = 4) -> int:
    """``nemo-anchor train`` of the tiny model into ``output_dir`` (config beside it); its exit status."""
    return main(["train", "--config", str(write_tiny_config(output_dir, data_path, max_steps)), *overrides])
