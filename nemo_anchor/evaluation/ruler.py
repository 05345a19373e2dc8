"""RULER-style synthetic tasks (Hsieh et al., 2024), generated offline with the model's tokenizer.

Needle-in-a-haystack (NIAH) and variable tracking (VT) follow RULER's generators
(``scripts/data/synthetic/niah.py`` and ``variable_tracking.py``): the same needle sentence,
prompt templates (the "base" model template: task template then answer prefix), random keys and
values (adjective-noun words from RULER's ``wonderwords`` lists, 7-digit numbers, UUIDs),
insertion scheme and scoring. RULER's essay haystack needs a download, so the tasks RULER runs on
essays here use its "repeat" haystack (the noise sentence repeated); the tasks that are the same as
RULER's keep its name in their description.

Length control, as in RULER: the haystack is the largest number of units (noise sentences or
distractor needles) for which ``prompt tokens + max_new_tokens <= target length``, counted with the
model's own tokenizer (special tokens included).
"""
from __future__ import annotations

import functools
import random
import string
import uuid
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

from nemo_anchor.evaluation.scoring import string_match_all

NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NIAH_TEMPLATE = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n{context}\n"
    "What are all the special magic {kind} for {query} mentioned in the provided text?"
    " The special magic {kind} for {query} mentioned in the provided text are"
)
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
    # "assgined" is RULER's spelling: kept so prompts match the benchmark token for token.
    " Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assgined the value {query}, they are: "
)

ValueKind = Literal["words", "numbers", "uuids"]


@dataclass(frozen=True)
class Sample:
    """One prompt and the strings a correct completion contains."""

    task: str
    prompt: str
    answers: list[str]
    num_prompt_tokens: int
    max_new_tokens: int
    target_length: int
    haystack_units: int


@dataclass(frozen=True)
class NeedleTask:
    """Needle in a haystack: find the value(s) stored under the queried key(s).

    ``num_keys`` needles' keys are drawn (distinct), each with ``num_values`` values; the
    question asks for ``num_queries`` of the keys and expects all their values.
    """

    name: str
    description: str
    haystack: Literal["repeat", "needle"] = "repeat"
    key_kind: ValueKind = "words"
    value_kind: ValueKind = "numbers"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    max_new_tokens: int = 128
    metric: Callable[[Sequence[str], Sequence[Sequence[str]]], float] = field(default=string_match_all, repr=False)

    def __post_init__(self):
        if not 1 <= self.num_queries <= self.num_keys or self.num_values < 1:
            raise ValueError(f"{self.name}: need 1 <= num_queries <= num_keys and num_values >= 1")

    @property
    def min_units(self) -> int:
        return self.num_keys * self.num_values  # RULER draws a distinct haystack slot per needle

    def render(self, num_units: int, rng: random.Random) -> tuple[str, list[str]]:
        """The prompt with ``num_units`` haystack units, and the expected answers."""
        keys = _distinct(lambda: _draw(self.key_kind, rng), self.num_keys)
        values = [[_draw(self.value_kind, rng) for _ in range(self.num_values)] for _ in keys]
        needles = [
            NEEDLE.format(kind=self.value_kind, key=key, value=value)
            for key, key_values in zip(keys, values)
            for value in key_values
        ]
        rng.shuffle(needles)
        if self.haystack == "repeat":
            units = [NOISE] * num_units
        else:
            # Distractors never reuse a real key, so the answer stays unique.
            units = [
                NEEDLE.format(
                    kind=self.value_kind, key=self._distractor_key(keys, rng), value=_draw(self.value_kind, rng)
                )
                for _ in range(num_units)
            ]
        for index, needle in zip(sorted(rng.sample(range(num_units), len(needles)), reverse=True), needles):
            units.insert(index, needle)
        queried = rng.sample(range(self.num_keys), self.num_queries)
        queries = [keys[index] for index in queried]
        answers = [value for index in queried for value in values[index]]
        query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
        template, kind = NIAH_TEMPLATE, self.value_kind
        if len(answers) == 1:  # RULER's singular wording
            template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
            kind = kind[:-1]
        return template.format(kind=kind, context="\n".join(units), query=query), answers

    def _distractor_key(self, keys: list[str], rng: random.Random) -> str:
        key = _draw(self.key_kind, rng)
        while key in keys:
            key = _draw(self.key_kind, rng)
        return key


@dataclass(frozen=True)
class VariableTrackingTask:
    """Variable tracking: list every variable a chain of assignments ``VAR B = VAR A`` binds to a value.

    With ``fewshot`` the prompt opens with one solved example (``fewshot_units`` noise lines,
    3-letter variables), as RULER does for base models.
    """

    name: str
    description: str
    num_chains: int = 1
    num_hops: int = 4
    fewshot: bool = True
    fewshot_units: int = 10  # about RULER's 500-token example with a Llama tokenizer
    max_new_tokens: int = 30
    metric: Callable[[Sequence[str], Sequence[Sequence[str]]], float] = field(default=string_match_all, repr=False)

    @property
    def min_units(self) -> int:
        return self.num_hops + 1  # RULER needs more noise lines than chain statements

    def render(self, num_units: int, rng: random.Random) -> tuple[str, list[str]]:
        """The prompt with ``num_units`` noise lines, and the chain's variables (the answers)."""
        prefix = ""
        if self.fewshot:
            example, example_answers = self._render(max(self.fewshot_units, self.min_units), rng, name_length=3)
            prefix = f"{example} {' '.join(example_answers)}\n\n"
        prompt, answers = self._render(num_units, rng, name_length=5)
        return prefix + prompt, answers

    def _render(self, num_units: int, rng: random.Random, name_length: int) -> tuple[str, list[str]]:
        chain_length = self.num_hops + 1
        names = _distinct(
            lambda: "".join(rng.choices(string.ascii_uppercase, k=name_length)), self.num_chains * chain_length
        )
        values = _distinct(lambda: str(rng.randint(10000, 99999)), self.num_chains)
        sentences = [NOISE + "\n"] * num_units
        for chain_index, value in enumerate(values):
            chain = names[chain_index * chain_length : (chain_index + 1) * chain_length]
            statements = [f"VAR {chain[0]} = {value}"]
            statements += [f"VAR {chain[j + 1]} = VAR {chain[j]} " for j in range(self.num_hops)]
            for offset, position in enumerate(sorted(rng.sample(range(len(sentences)), len(statements)))):
                sentences.insert(position + offset, statements[offset])
        context = " ".join(sentences).replace(". \n", ".\n")
        prompt = VT_TEMPLATE.format(context=context, query=values[0], num_v=chain_length)
        return prompt, names[:chain_length]


Task = NeedleTask | VariableTrackingTask

TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        NeedleTask("niah_single", "one needle, repeat haystack (RULER niah_single_1)"),
        NeedleTask(
            "niah_multikey", "4 keys, 1 queried, repeat haystack (RULER niah_multikey_1 uses essays)", num_keys=4
        ),
        NeedleTask("niah_multikey_needle", "haystack of distractor needles (RULER niah_multikey_2)", haystack="needle"),
        NeedleTask(
            "niah_multikey_needle_uuid", "distractor needles, UUID keys and values (RULER niah_multikey_3)",
            haystack="needle", key_kind="uuids", value_kind="uuids",
        ),
        NeedleTask(
            "niah_multivalue", "1 key with 4 values, repeat haystack (RULER niah_multivalue uses essays)", num_values=4
        ),
        NeedleTask(
            "niah_multiquery", "4 keys, all 4 queried, repeat haystack (RULER niah_multiquery uses essays)",
            num_keys=4, num_queries=4,
        ),
        VariableTrackingTask("vt", "1 chain of 4 hops in noise, one solved example first (RULER vt)"),
    )
}


def generate_samples(task: Task, tokenizer, target_length: int, num_samples: int, seed: int = 0) -> list[Sample]:
    """``num_samples`` prompts of ``task`` that fit ``target_length`` tokens with room to answer.

    Sample ``i`` draws its content from ``random.Random(f"{task.name}/{target_length}/{seed}/{i}")``,
    so the same settings give the same prompts on any machine. The haystack size is searched for the
    first sample and reduced for a later one only when its content tokenizes longer, as in RULER.
    """
    budget = target_length - task.max_new_tokens

    def count_tokens(num_units: int, sample_index: int) -> tuple[int, str, list[str]]:
        prompt, answers = task.render(num_units, random.Random(f"{task.name}/{target_length}/{seed}/{sample_index}"))
        return len(tokenizer(prompt)["input_ids"]), prompt, answers

    smallest, *_ = count_tokens(task.min_units, 0)
    if smallest > budget:
        raise ValueError(
            f"task {task.name}: {target_length} tokens cannot hold its smallest prompt "
            f"({smallest} tokens) plus {task.max_new_tokens} tokens to generate"
        )
    units = _largest_fitting(task.min_units, lambda n: count_tokens(n, 0)[0] <= budget)
    samples = []
    for index in range(num_samples):
        num_tokens, prompt, answers = count_tokens(units, index)
        while num_tokens > budget and units > task.min_units:
            units -= 1
            num_tokens, prompt, answers = count_tokens(units, index)
        if num_tokens > budget:
            raise ValueError(f"task {task.name}: sample {index} does not fit {target_length} tokens")
        samples.append(Sample(task.name, prompt, answers, num_tokens, task.max_new_tokens, target_length, units))
    return samples


def _largest_fitting(smallest: int, fits: Callable[[int], bool]) -> int:
    """Largest ``n >= smallest`` with ``fits(n)``, given ``fits(smallest)`` and that ``fits`` turns false for good."""
    low, step = smallest, 1
    while fits(low + step):  # gallop up, then bisect: O(log n) tokenizations of long prompts
        low, step = low + step, step * 2
    high = low + step  # does not fit
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _draw(kind: ValueKind, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    adjectives, nouns = _word_lists()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


@functools.cache
def _word_lists() -> tuple[list[str], list[str]]:
    """RULER's key vocabulary: wonderwords' adjective and noun lists, sorted for reproducibility."""
    from wonderwords import RandomWord

    words = RandomWord()
    adjectives = sorted(set(words.filter(include_categories=["adjective"])))
    return adjectives, sorted(set(words.filter(include_categories=["noun"])))


def _distinct(draw: Callable[[], str], count: int) -> list[str]:
    drawn: list[str] = []
    while len(drawn) < count:
        candidate = draw()
        if candidate not in drawn:
            drawn.append(candidate)
    return drawn
