"""`nemo-anchor eval` end to end on tiny random HF models, perplexity buckets, checkpoint averaging, inputs."""
import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from nemo_anchor.cli import main
from nemo_anchor.evaluation import perplexity, runner
from nemo_anchor.evaluation.checkpoints import last_checkpoints
from nemo_anchor.evaluation.corpus import read_token_windows
from nemo_anchor.evaluation.models import load_model
from nemo_anchor.evaluation.perplexity import perplexity_by_position
from nemo_anchor.evaluation.ruler import NIAH_TEMPLATE, NOISE, VT_TEMPLATE

TEXT = (NOISE + " One of the special magic numbers for tall-tree is: 1234567.\n") * 40


def make_tokenizer():
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator([NIAH_TEMPLATE, VT_TEMPLATE, TEXT], trainer)
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bpe.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")


def save_tiny_model(directory, seed):
    tokenizer = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), seed=0)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_eval_command_end_to_end(model_dir, text_file, tmp_path):
    out = tmp_path / "out"
    code = main([
        "eval", "--hf", str(model_dir), "--output", str(out), "--tasks", "niah_single", "vt",
        "--lengths", "1024", "--num-samples", "2", "--max-new-tokens", "4", "--dtype", "fp32",
        "--perplexity-data", str(text_file), "--perplexity-length", "64", "--perplexity-windows", "2",
        "--perplexity-buckets", "4",
    ])
    assert code == 0
    report = json.loads((out / "eval.json").read_text())
    (run,) = report["runs"]
    assert set(run["ruler"]) == {"niah_single", "vt"} and set(run["ruler"]["vt"]) == {"1024"}
    assert all(0.0 <= score <= 100.0 for scores in run["ruler"].values() for score in scores.values())
    assert report["mean"] == {key: run[key] for key in ("ruler", "ruler_average", "perplexity")}
    assert run["perplexity"]["starts"] == [1, 16, 32, 48] and run["perplexity"]["ends"] == [16, 32, 48, 64]
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 4 and {record["task"] for record in predictions} == {"niah_single", "vt"}
    assert all(record["prompt_tokens"] + 4 <= 1024 for record in predictions)
    assert (out / "eval.png").read_bytes().startswith(b"\x89PNG")


def test_scores_come_from_the_completions(model_dir, monkeypatch):
    """With completions replaced by the answers (or by nothing) the pipeline must score 100 (or 0)."""
    model, tokenizer = load_model(model_dir, dtype=torch.float32)
    settings = runner.EvalSettings(tasks=("niah_multivalue", "niah_multiquery"), lengths=(400,), num_samples=2, max_new_tokens=8)
    prompts_to_answers = {}
    real_generate = runner.generate_samples

    def remember_answers(*args, **kwargs):
        samples = real_generate(*args, **kwargs)
        prompts_to_answers.update({sample.prompt: sample.answers for sample in samples})
        return samples

    monkeypatch.setattr(runner, "generate_samples", remember_answers)
    monkeypatch.setattr(runner, "greedy_completion", lambda m, t, prompt, n: " " + ", ".join(prompts_to_answers[prompt]).upper())
    result, predictions = runner.evaluate_model(model, tokenizer, settings)
    assert result["ruler_average"] == {"400": 100.0}
    monkeypatch.setattr(runner, "greedy_completion", lambda m, t, prompt, n: "\x00 no idea")
    result, _ = runner.evaluate_model(model, tokenizer, settings)
    assert result["ruler"] == {"niah_multivalue": {"400": 0.0}, "niah_multiquery": {"400": 0.0}}


def test_perplexity_buckets_match_a_direct_computation(model_dir, monkeypatch):
    model, _ = load_model(model_dir, dtype=torch.float32)
    windows = torch.randint(0, model.config.vocab_size, (3, 50), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(perplexity, "_LOGIT_CHUNK", 7)  # several logit chunks per window
    measured = perplexity_by_position(model, windows, num_buckets=5)
    with torch.no_grad():
        log_probs = torch.log_softmax(model(windows).logits.double(), dim=-1)
    nll = -log_probs[:, :-1].gather(-1, windows[:, 1:, None])[..., 0]  # nll[:, t - 1] is the loss of target t
    for start, end, value, count in zip(measured.starts, measured.ends, measured.nll, measured.num_tokens):
        assert count == 3 * (end - start)
        assert value == pytest.approx(nll[:, start - 1 : end - 1].mean().item(), rel=1e-5)
    assert measured.starts[0] == 1 and measured.ends[-1] == 50
    assert measured.perplexity == pytest.approx(torch.tensor(measured.nll).exp().tolist())


def test_last_k_checkpoints_are_evaluated_and_averaged(tmp_path, text_file):
    run_dir = tmp_path / "run"
    for iteration, seed in ((5, 1), (10, 2), (20, 3)):
        save_tiny_model(run_dir / "checkpoints" / f"iter_{iteration:07d}", seed)
    (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("20")
    assert [iteration for iteration, _ in last_checkpoints(run_dir, 2)] == [10, 20]
    out = tmp_path / "out"
    main([
        "eval", "--checkpoint", str(run_dir), "--last-k", "2", "--output", str(out), "--tasks",
        "--perplexity-data", str(text_file), "--perplexity-length", "48", "--perplexity-windows", "1",
        "--perplexity-buckets", "3", "--dtype", "fp32",
    ])
    report = json.loads((out / "eval.json").read_text())
    assert [run["iteration"] for run in report["runs"]] == [10, 20]
    first, second = (run["perplexity"]["nll"] for run in report["runs"])
    assert first != second  # different weights
    assert report["mean"]["perplexity"]["nll"] == pytest.approx([(a + b) / 2 for a, b in zip(first, second)])
    with pytest.raises(ValueError, match="checkpoints"):
        last_checkpoints(tmp_path / "elsewhere", 2)


def test_token_windows_from_text_and_jsonl(tmp_path):
    tokenizer = make_tokenizer()
    documents = ["The grass is green.", "The sky is blue. Here we go."]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    windows = read_token_windows([jsonl], tokenizer, num_windows=2, length=5)
    stream = []
    for text in documents:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert windows[:, 0].tolist() == [tokenizer.bos_token_id] * 2
    assert windows[:, 1:].flatten().tolist() == stream[:8]
    with pytest.raises(ValueError, match="windows"):
        read_token_windows([jsonl], tokenizer, num_windows=50, length=64)
    jsonl.write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    with pytest.raises(ValueError, match=r"docs.jsonl:2"):
        read_token_windows([jsonl], tokenizer, num_windows=1, length=64)


def test_unfit_tasks_are_all_reported_before_any_decoding():
    settings = runner.EvalSettings(tasks=("vt", "niah_multiquery", "niah_single"), lengths=(300,), num_samples=1)
    with pytest.raises(ValueError, match=r"(?s)task vt: 300 tokens.*task niah_multiquery: 300 tokens") as error:
        runner.build_prompts(make_tokenizer(), settings, [300])
    assert "niah_single" not in str(error.value)
