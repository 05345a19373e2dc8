"""AnchorAttention on Megatron-Bridge 0.6 (Python 3.12, megatron-core 0.19): NVIDIA's current LLM stack.

- :mod:`nemo_anchor.bridge.provider`: ``AnchorGPTModelProvider``, a ``GPTModelProvider`` with our layer spec.
- :mod:`nemo_anchor.bridge.convert`: ``import_hf`` / ``export_hf`` through ``AutoBridge``.
- :mod:`nemo_anchor.bridge.data`: a Bridge dataset provider over ``nemo-anchor pack`` output.
- :mod:`nemo_anchor.bridge.recipes` and ``python -m nemo_anchor.bridge.pretrain``: Bridge's ``pretrain()``.

Without CUDA, importing this package first installs the CPU shims Bridge needs
(:mod:`nemo_anchor.bridge.cpu`).
"""
from nemo_anchor.bridge.cpu import install_import_shims, install_runtime_shims

install_import_shims()
try:
    import megatron.bridge  # noqa: F401
except Exception as error:  # noqa: BLE001 - a CPU-only Transformer Engine raises RuntimeError, not ImportError
    raise ImportError(
        "nemo_anchor.bridge needs Megatron-Bridge 0.6 (Python 3.12, megatron-core 0.19): in an NVIDIA container "
        "that ships it, `pip install --no-deps -e .`; elsewhere the .venv-bridge of scripts/setup_env.sh; "
        f"importing it failed: {type(error).__name__}: {error}. NeMo 2 users: nemo_anchor.nemo.config") from error
install_runtime_shims()

from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix  # noqa: E402

# Bridge re-creates a checkpoint's provider (and its spec and step functions) from run_config.yaml
# only for allow-listed modules
register_allowed_target_prefix("nemo_anchor.")

from nemo_anchor.bridge.convert import export_hf, import_hf  # noqa: E402
from nemo_anchor.bridge.provider import AnchorGPTModelProvider  # noqa: E402

__all__ = ["AnchorGPTModelProvider", "export_hf", "import_hf"]
