"""SmolLM2-135M-Instruct end to end, the users' path: import-hf, continued training, export-hf, transformers.

fp32 on the CPU throughout, so the conversions can be held to 1e-4 against transformers.
"""
import json

import pytest
import torch
import transformers
import yaml

from nemo_anchor.cli import main as cli
from nemo_anchor.export.inference import load_checkpoint, load_hf_model

TEXT = ("The capital of France is Paris. It is known for the Eiffel Tower, which was built in 1889 "
        "for the World's Fair and is now one of the most visited monuments in the world.")
CORPUS = [
    "Rotary position embeddings encode the position of a token by rotating its query and key vectors.",
    "Long-context training packs several documents into one window and masks attention between them.",
    "The Python standard library includes modules for regular expressions, dates and file handling.",
    "Photosynthesis converts light energy into chemical energy stored in glucose molecules.",
] * 8
WINDOW = 64


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """(transformers model in fp32, tokenizer) of the prepared directory."""
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def imported(smollm2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "run"
    assert cli(["import-hf", str(smollm2_dir), str(out)]) == 0
    return out


def test_import_keeps_transformers_logits_on_real_text(reference, imported):
    reference, tokenizer = reference
    tokens = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    assert tokens[0, 0] == tokenizer.bos_token_id and tokens.shape[1] > 30
    ours = load_checkpoint(imported)
    assert ours.config.tie_embeddings and ours.config.num_layers == 30
    with torch.no_grad():
        expected = reference(tokens).logits
        assert (ours(tokens) - expected).abs().max() <= 1e-4
        as_exported, _ = load_hf_model(imported)  # what export-hf writes, built in memory
        assert (as_exported(tokens).logits - expected).abs().max() <= 1e-4
    # the pretrained model, not noise: the next token after "The capital of France is" is " Paris"
    prompt = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert tokenizer.decode(ours(prompt)[0, -1].argmax()) == " Paris"


def test_continued_pretraining_export_and_generate(smollm2_dir, reference, imported, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in CORPUS))
    assert cli(["pack", "--input", str(corpus), "--tokenizer", str(smollm2_dir), "--seq-length", str(WINDOW),
                "--output", str(tmp_path / "packed")]) == 0
    config = tmp_path / "train.yaml"  # the model section import-hf wrote, trained on a shorter window
    config.write_text(yaml.safe_dump({**yaml.safe_load((imported / "config.yaml").read_text()),
                                      "trainer": {"max_steps": 1, "global_batch_size": 1, "precision": "fp32",
                                                  "progress_bar": False},
                                      "optim": {"lr": 1e-4}}))
    assert cli(["train", "--config", str(config), f"output_dir={imported}", f"data.path={tmp_path / 'packed'}",
                f"model.seq_length={WINDOW}", "model.attention_type=anchor"]) == 0
    losses = [json.loads(line) for line in (imported / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in losses if "loss" in r] == [1]
    assert all(0 < r["loss"] < 10 for r in losses if "loss" in r)  # a pretrained model, not log(49152) = 10.8

    exported = tmp_path / "hf"
    assert cli(["export-hf", str(imported), str(exported)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert type(hf) is transformers.LlamaForCausalLM and hf.config.tie_word_embeddings
    assert hf.config.max_position_embeddings == WINDOW
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    tokens = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    original, _ = reference
    with torch.no_grad():
        trained = hf(tokens).logits
        assert (load_checkpoint(imported)(tokens) - trained).abs().max() <= 1e-4
        assert (original(tokens).logits - trained).abs().max() > 1e-3  # the step moved the weights

    prompt = tokenizer("The capital of France is", return_tensors="pt")
    generated = hf.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(generated[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert generated.shape[1] > prompt["input_ids"].shape[1] and text.strip()


@pytest.mark.parametrize("config", ["configs/demo.yaml", "configs/ablation/smollm2.yaml"])
def test_shipped_smollm2_configs_match_the_model(smollm2_dir, config):
    """The demo's and the ablation's model sections are SmolLM2's shape, as import reads it from config.json."""
    from pathlib import Path

    from nemo_anchor.convert.hf_mapping import model_config_from_hf

    shipped = yaml.safe_load((Path(__file__).parents[1] / config).read_text())["model"]
    expected = vars(model_config_from_hf(transformers.AutoConfig.from_pretrained(smollm2_dir)))
    for key in ("architecture", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_query_groups", "tie_embeddings"):
        assert shipped[key] == expected[key], key
    assert shipped["norm_epsilon"] == pytest.approx(expected["norm_epsilon"], rel=1e-6)  # the GGUF stores fp32
    assert float(shipped["rotary_base"]) == float(expected["rotary_base"])
