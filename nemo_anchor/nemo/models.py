"""NeMo 2 model classes of the AnchorAttention configs, with their own Hugging Face importers and exporters.

``AnchorLlamaModel``, ``AnchorMistralModel`` and ``AnchorQwen2Model`` are NeMo's ``LlamaModel``,
``MistralModel`` and ``Qwen2Model``; registering ``hf`` connectors on the subclasses
(below, built from ``nemo_anchor.nemo.hf_io``) makes ``llm.import_ckpt`` build an Anchor config, and makes both
directions map every weight or fail naming it.
"""
from typing import Optional

from nemo.collections import llm
from nemo.collections.llm.gpt.model.llama import HFLlamaExporter, HFLlamaImporter
from nemo.collections.llm.gpt.model.mistral import HFMistralExporter, HFMistralImporter
from nemo.collections.llm.gpt.model.qwen2 import HFQwen2Exporter, HFQwen2Importer
from nemo.lightning import io

from nemo_anchor.nemo.config import AnchorLlamaConfig, AnchorMistralConfig, AnchorQwen2Config
from nemo_anchor.nemo.hf_io import AnchorExporter, AnchorImporter


class AnchorLlamaModel(llm.LlamaModel):
    """``llm.LlamaModel`` of an :class:`AnchorLlamaConfig` (Llama, SmolLM2)."""

    def __init__(self, config: Optional[AnchorLlamaConfig] = None, optim=None, tokenizer=None, model_transform=None):
        super().__init__(config or AnchorLlamaConfig(), optim=optim, tokenizer=tokenizer, model_transform=model_transform)


class AnchorMistralModel(llm.MistralModel):
    """``llm.MistralModel`` of an :class:`AnchorMistralConfig`."""

    def __init__(self, config: Optional[AnchorMistralConfig] = None, optim=None, tokenizer=None, model_transform=None):
        super().__init__(config or AnchorMistralConfig(), optim=optim, tokenizer=tokenizer,
                         model_transform=model_transform)


class AnchorQwen2Model(llm.Qwen2Model):
    """``llm.Qwen2Model`` of an :class:`AnchorQwen2Config`."""

    def __init__(self, config: Optional[AnchorQwen2Config] = None, optim=None, tokenizer=None, model_transform=None):
        super().__init__(config or AnchorQwen2Config(), optim=optim, tokenizer=tokenizer, model_transform=model_transform)


# the NeMo model class of each config class family
MODEL_CLASSES = {AnchorLlamaConfig: AnchorLlamaModel, AnchorMistralConfig: AnchorMistralModel,
                 AnchorQwen2Config: AnchorQwen2Model}


def model_class_for(config_class: type) -> type:
    return next(model for base, model in MODEL_CLASSES.items() if issubclass(config_class, base))


# ---------------------------------------------------------------- hf importers and exporters

@io.model_importer(AnchorLlamaModel, "hf")
class AnchorHFLlamaImporter(AnchorImporter, HFLlamaImporter):
    MODEL_CLASS, CONFIG_FAMILY = AnchorLlamaModel, AnchorLlamaConfig


@io.model_importer(AnchorMistralModel, "hf")
class AnchorHFMistralImporter(AnchorImporter, HFMistralImporter):
    MODEL_CLASS, CONFIG_FAMILY = AnchorMistralModel, AnchorMistralConfig


@io.model_importer(AnchorQwen2Model, "hf")
class AnchorHFQwen2Importer(AnchorImporter, HFQwen2Importer):
    MODEL_CLASS, CONFIG_FAMILY = AnchorQwen2Model, AnchorQwen2Config


@io.model_exporter(AnchorLlamaModel, "hf")
class AnchorHFLlamaExporter(AnchorExporter, HFLlamaExporter):
    pass


@io.model_exporter(AnchorMistralModel, "hf")
class AnchorHFMistralExporter(AnchorExporter, HFMistralExporter):
    pass


@io.model_exporter(AnchorQwen2Model, "hf")
class AnchorHFQwen2Exporter(AnchorExporter, HFQwen2Exporter):
    pass
