"""The smallest real training run, shared by the robustness tests: a 1-layer model on 64-token byte windows."""
import json
import os
import random
import socket
from pathlib import Path

import yaml

from nemo_anchor.cli import main
from nemo_anchor.data import PackOptions, pack

REPO = Path(__file__).resolve().parents[1]
TEXTS = ["The quick brown fox jumps over the lazy dog. " * 6, "Pack my box with five dozen liquor jugs! " * 4] * 8


def pack_texts(root, texts=TEXTS, tokenizer: str = "byte", name: str = "byte", seq_length: int = 64):
    """``texts`` as ``root/corpus.jsonl``, packed with ``tokenizer`` into ``root/name``; returns that directory."""
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pack([corpus], tokenizer, root / name, PackOptions(seq_length=seq_length))
    return root / name


def train_tiny(output_dir, data_path, *overrides, max_steps: int = 4) -> int:
    """``nemo-anchor train`` of the tiny model into ``output_dir`` (config beside it); its exit status."""
    return main(["train", "--config", str(tiny_config(output_dir, data_path, max_steps=max_steps)), *overrides])


def tiny_config(output_dir, data_path, max_steps: int = 4, global_batch_size: int = 1, seq_length: int = 64):
    """The tiny run's config for ``output_dir``, written beside it; its path."""
    config = {
        "output_dir": str(output_dir),
        "model": {"num_layers": 1, "hidden_size": 16, "ffn_hidden_size": 32, "num_attention_heads": 2,
                  "num_query_groups": 1, "seq_length": seq_length},
        "data": {"path": str(data_path)},
        "trainer": {"max_steps": max_steps, "global_batch_size": global_batch_size, "micro_batch_size": 1,
                    "precision": "fp32", "progress_bar": False},
        "checkpoint": {"save_every": 2, "keep_last": 2},
    }
    path = output_dir.parent / f"{output_dir.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def child_environment(**variables) -> dict:
    """os.environ for a launched child, plus ``variables``: without the rendezvous variables that an in-process
    run leaves behind (a child would try to join this process's group), with this checkout first on the path."""
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in launch}, "PYTHONWARNINGS": "ignore",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **variables}


def free_port() -> int:
    """A free TCP port for a launcher's rendezvous, below the kernel's ephemeral range (``ip_local_port_range``).

    Outgoing connections and ``bind(port 0)`` draw their ports from that range: a port found free there can be
    taken by another process's connection (gloo, a TCP store) before the launcher binds it, and a two-node run
    then hangs, one node waiting for a master that never started (seen in a four-lane run of the suite)."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.is_file() else 32768
    for _ in range(200):
        port = random.randrange(max(1024, low - 12_000), low)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free TCP port found below {low}")
