"""RULER-style task generation and scoring, checked by parsing the generated prompts."""
import random
import re

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from nemo_anchor.evaluation.ruler import (
    NEEDLE, NIAH_TEMPLATE, NOISE, TASKS, VT_TEMPLATE, NeedleTask, VariableTrackingTask, generate_samples,
)
from nemo_anchor.evaluation.scoring import postprocess_prediction, string_match_all

NEEDLE_PATTERN = re.compile(r"One of the special magic (\w+) for (.+?) is: (\S+)\.")


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE fitted on the task text (every string round-trips; prompts compress as with a real tokenizer)."""
    corpus = [NIAH_TEMPLATE, VT_TEMPLATE, NOISE * 20, NEEDLE, "VAR ABCDE = VAR FGHIJ 12345 numbers words uuids"] * 5
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus, trainer)
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bpe.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")


def seeded(task, target_length, seed, index):
    """The generator draws sample ``index`` from this RNG (documented in ``generate_samples``)."""
    return random.Random(f"{task.name}/{target_length}/{seed}/{index}")


def needles_in(prompt):
    """key -> values of every needle sentence in the prompt, and the non-needle context lines."""
    context = prompt.split("afterwards.\n", 1)[1].rsplit("\nWhat ", 1)[0]
    stored, other_lines = {}, []
    for line in context.split("\n"):
        match = NEEDLE_PATTERN.fullmatch(line)
        if match:
            stored.setdefault(match.group(2), []).append(match.group(3))
        else:
            other_lines.append(line)
    return stored, other_lines


def queried_keys(prompt):
    query = re.search(r"special magic \w+ for (.+?) mentioned in the provided text\?", prompt).group(1)
    return [key.strip() for key in re.split(r", and |, ", query)]


@pytest.mark.parametrize("name", [name for name, task in TASKS.items() if isinstance(task, NeedleTask)])
def test_needle_prompts_hold_the_answers_and_fill_the_target_length(tokenizer, name):
    task, target = TASKS[name], 1024
    samples = generate_samples(task, tokenizer, target, num_samples=3, seed=7)
    budget = target - task.max_new_tokens
    for index, sample in enumerate(samples):
        assert sample.num_prompt_tokens == len(tokenizer(sample.prompt)["input_ids"]) <= budget
        stored, other_lines = needles_in(sample.prompt)
        keys = queried_keys(sample.prompt)
        assert len(keys) == task.num_queries
        # The answers are exactly the values stored under the queried keys, once each.
        assert sorted(sample.answers) == sorted(value for key in keys for value in stored[key])
        assert all(len(stored[key]) == task.num_values for key in keys)
        if task.haystack == "repeat":
            assert set(other_lines) == {NOISE} and len(stored) == task.num_keys
        else:
            assert other_lines == [] and len(stored) == task.num_keys + sample.haystack_units
        prompt_plus_one, _ = task.render(sample.haystack_units + 1, seeded(task, target, 7, index))
        if index == 0:  # the haystack was searched on sample 0: one more unit no longer fits
            assert len(tokenizer(prompt_plus_one)["input_ids"]) > budget


def test_singular_wording_for_one_answer(tokenizer):
    single = generate_samples(TASKS["niah_single"], tokenizer, 512, num_samples=1)[0]
    assert single.prompt.startswith("A special magic number is hidden")
    assert single.prompt.endswith("mentioned in the provided text is")
    multi = generate_samples(TASKS["niah_multivalue"], tokenizer, 512, num_samples=1)[0]
    assert multi.prompt.startswith("Some special magic numbers are hidden")
    assert len(multi.answers) == 4


def follow_chains(text):
    """value -> every variable bound to it through ``VAR B = VAR A`` chains."""
    direct = dict(re.findall(r"VAR (\w+) = (\d+)", text))
    copies = re.findall(r"VAR (\w+) = VAR (\w+)", text)
    bound = {}
    for variable, value in direct.items():
        group, grew = {variable}, True
        while grew:
            new = {target for target, source in copies if source in group} - group
            group |= new
            grew = bool(new)
        bound[value] = group
    return bound


@pytest.mark.parametrize("fewshot", [False, True])
def test_variable_tracking_answer_follows_the_chain(tokenizer, fewshot):
    task = VariableTrackingTask("vt_test", "test", fewshot=fewshot, fewshot_units=6)
    for sample in generate_samples(task, tokenizer, 768, num_samples=2, seed=3):
        *examples, question = sample.prompt.split("Memorize and track")
        assert len(examples) == (2 if fewshot else 1)  # examples[0] is the empty text before the first template
        value = re.search(r"assigned the value (\d+) in the text above", question).group(1)
        assert set(sample.answers) == follow_chains(question)[value]
        assert len(sample.answers) == task.num_hops + 1 and all(len(name) == 5 for name in sample.answers)
        if fewshot:  # the solved example lists its own chain after its prompt
            example = examples[1]
            example_value = re.search(r"assigned the value (\d+) in the text above", example).group(1)
            listed = example.rsplit("they are: ", 1)[1].split()
            assert set(listed) == follow_chains(example)[example_value]
        assert sample.num_prompt_tokens + task.max_new_tokens <= 768


def test_token_budget_holds_at_several_lengths_and_too_short_is_refused(tokenizer):
    task = TASKS["niah_multikey_needle"]
    haystack_sizes = []
    for target in (320, 448, 576):
        samples = generate_samples(task, tokenizer, target, num_samples=2)
        assert all(sample.num_prompt_tokens + task.max_new_tokens <= target for sample in samples)
        haystack_sizes.append(samples[0].haystack_units)
    assert haystack_sizes == sorted(haystack_sizes) and haystack_sizes[0] < haystack_sizes[-1]
    with pytest.raises(ValueError, match="niah_multiquery"):
        generate_samples(TASKS["niah_multiquery"], tokenizer, 160, num_samples=1)


def test_generation_is_reproducible_and_seeded(tokenizer):
    task = TASKS["niah_multikey"]
    first = generate_samples(task, tokenizer, 512, num_samples=2, seed=1)
    assert first == generate_samples(task, tokenizer, 512, num_samples=2, seed=1)
    assert first[0].prompt != generate_samples(task, tokenizer, 512, num_samples=2, seed=2)[0].prompt
    assert first[0].prompt != first[1].prompt


def test_string_match_scores_hand_checked_cases():
    predictions = ["The numbers are 123 and 456.", "nothing here", "APPLE-TREE"]
    references = [["123", "456", "789"], ["1"], ["apple-tree", "pear"]]
    assert string_match_all(predictions, references) == pytest.approx(100 * (2 / 3 + 0 + 1 / 2) / 3)
    with pytest.raises(ValueError):
        string_match_all(["a"], [])


def test_postprocess_matches_ruler():
    assert postprocess_prediction("  1234\x00567\t89 \n") == "1234\n567\n89"
