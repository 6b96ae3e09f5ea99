"""The bundled TinyStories tasks for lm-eval, and the TaskManager that finds them beside standard and user tasks.

Bundled tasks (`BUNDLED_TASKS`) are generated from the run's validation split into the data cache
(`<prepared dir>/lm_eval_tasks/`), never hand-written; the generators are pure functions of (stories, seed, n_docs):
- tinystories_ppl: rolling log-likelihood of held-out stories -> word_perplexity, byte_perplexity, bits_per_byte.
- tinystories_ending: the true last sentence of a story vs the last sentences of three other stories (acc, acc_norm).
- tinystories_names: the protagonist's name at its next mention vs the protagonists of three other stories (acc,
  acc_norm); see `find_protagonist` for the rule.
- tinystories_order: a validation sentence vs the same words with one function word moved in front of the word
  before it (acc); see `make_order_docs` for the rule that makes the swapped sentence ungrammatical.
The ending and names tasks are balanced: documents come in groups of four stories that share the same four choices
(the group's answers, in one order), so every choice is right exactly once per group and a model that ignores the
story — a prior for frequent names such as "Lily", a favourite position — scores exactly 1/4 (`_group_docs`). The
order task is balanced the same way in pairs, so a model that ignores word order scores exactly 1/2. Together they
are a ladder of what a small model has learned: local syntax (order), then entity tracking (names), then story
tracking (ending); each template states its chance level in `metadata.chance` (the report tests against it).

Each generator has a version (`TASK_VERSIONS`, bump it when its output changes); the rendered YAML carries it in
`metadata.version`, and the stored `task_version` is "<version>+<sha256 of the documents, 12 hex>", so two rows with
the same task_version were computed on exactly the same documents. The YAML templates live in `benchctl/tasks/`;
the rendered copies hold absolute data paths (lm-eval resolves relative ones against the working directory) and are
loaded with `TaskManager(include_path=...)`; a YAML that fails to parse is skipped silently by lm-eval, so every
bundled task is checked to be found.

Standard lm-eval tasks (hellaswag, lambada_openai, blimp_* ...) are accepted by name or glob, and so are tasks from
the user's own YAML directories (`include_paths`); lm-eval's own task list, many thousands of entries and slow to
index, is indexed only when a name is not found among those.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from lm_eval.tasks import TaskManager

from architectures import did_you_mean
from benchctl.core import data as datamod
from benchctl.core.errors import ConfigError, EvalError
from benchctl.core.files import atomic_write
from benchctl.stages.eval.options import BUNDLED_TASKS, DEFAULT_DOCS

TASK_VERSIONS = {"tinystories_ppl": 1, "tinystories_ending": 1, "tinystories_names": 1, "tinystories_order": 1}
TASK_SEED = 1234  # seed of the document selection and the distractors
TEMPLATES = Path(__file__).parent / "task_yaml"  # the bundled task YAMLs, shipped as package data
TASKS_SUBDIR = "lm_eval_tasks"

# ====================================================================================================================
# Bundled tasks: document generators (pure functions of the validation stories)

# A sentence ends at . ! or ? (possibly followed by closing quotes) and whitespace.
_SENT_END = re.compile(r"[.!?][\"'”’]*\s+")
_QUOTES = set("\"'“”‘’")
_CAP_WORD = re.compile(r"\b[A-Z][a-z]+\b")
_INTRO = re.compile(r"\b(?:named|called)\s+([A-Z][a-z]+)\b|\b[Nn]ame (?:was|is)\s+([A-Z][a-z]+)\b")
# Capitalised words that are not character names in TinyStories: roles used as names, interjections, sentence
# openers, calendar words. (Capitalised words seen only at sentence starts are excluded by the rule itself.)
NOT_NAMES = frozenset(
    """
Mom Mommy Mum Mummy Mama Momma Dad Daddy Papa Pa Ma Grandma Grandpa Granny Grandad Nana Papa Mr Mrs Ms Miss Sir
Madam Aunt Auntie Uncle Doctor Teacher King Queen Prince Princess God Santa The Once One Then When But And So They
She He It Yes No Oh Wow Okay Ok Hello Hi Bye Goodbye Thank Thanks Please Sorry Let Look Come Go Stop Don Can What Why
How Where Who Good Hey Help Sure Ouch Yay Hooray Monday Tuesday Wednesday Thursday Friday Saturday Sunday January
February March April May June July August September October November December Christmas Halloween Easter Spring
Summer Autumn Fall Winter Earth English
""".split()
)


def last_sentence_split(story: str) -> tuple[str, str] | None:
    """(context including the separating whitespace, last sentence) or None when the story has a single sentence."""
    story = story.strip()
    ends = [m.end() for m in _SENT_END.finditer(story) if m.end() < len(story)]
    if not ends:
        return None
    return story[: ends[-1]], story[ends[-1] :]


def _ending_ok(context: str, sentence: str) -> bool:
    # A clean narrative sentence: no dialogue fragment, long enough to say something, after a real context.
    return len(sentence.split()) >= 4 and not (_QUOTES & set(sentence)) and len(context.strip()) >= 40


def _sentence_initial(text: str, i: int) -> bool:
    j = i - 1
    while j >= 0 and text[j] in " \t":
        j -= 1
    return j < 0 or text[j] in ".!?:\n" or text[j] in _QUOTES


def find_protagonist(story: str) -> tuple[str, int] | None:
    """(name, offset of the mention that introduces it), or None when the story has no clear named protagonist.

    The rule, in order:
    1. an introduction: the first "named X", "called X" or "name was/is X" where X is a capitalised word not in
       `NOT_NAMES` that is mentioned again later in the story;
    2. otherwise the capitalised word (not in `NOT_NAMES`) mentioned most often, at least twice, at least once
       in the middle of a sentence (so ordinary sentence-initial words are never taken for names); ties go to the
       earliest. Its introduction is its first mention.
    Stories where neither finds a name are dropped from the task.
    """
    m = _INTRO.search(story)
    if m:
        name = m.group(1) or m.group(2)
        start = m.start(1) if m.group(1) else m.start(2)
        if name not in NOT_NAMES and re.search(rf"\b{name}\b", story[start + len(name) :]):
            return name, start
    count: Counter[str] = Counter()
    first: dict[str, int] = {}
    mid: set[str] = set()
    for w in _CAP_WORD.finditer(story):
        name = w.group()
        if name in NOT_NAMES:
            continue
        count[name] += 1
        first.setdefault(name, w.start())
        if not _sentence_initial(story, w.start()):
            mid.add(name)
    candidates = [n for n in count if count[n] >= 2 and n in mid]
    if not candidates:
        return None
    name = max(candidates, key=lambda n: (count[n], -first[n]))
    return name, first[name]


def make_ppl_docs(stories: Sequence[str], n_docs: int = DEFAULT_DOCS, seed: int = TASK_SEED) -> list[dict[str, Any]]:
    """A seeded random subset of n_docs stories, in random order (so --limit takes a random subset too)."""
    rng = random.Random(f"tinystories_ppl:{seed}")
    eligible = [i for i, s in enumerate(stories) if s.strip()]
    rng.shuffle(eligible)
    return [{"text": stories[i].strip(), "story_idx": i} for i in eligible[:n_docs]]


@dataclass(frozen=True)
class _Item:
    story_idx: int
    context: str
    answer: str  # the true continuation: a last sentence, or a name
    story: str


def _balanced_groups(
    rng: random.Random, items: Sequence[_Item], k: int, n_groups: int, compatible: Callable[[_Item, _Item], bool]
) -> list[list[_Item]]:
    """Up to n_groups groups of k mutually compatible items, greedily from a seeded shuffle of `items`."""
    order = list(items)
    rng.shuffle(order)
    open_groups: list[list[_Item]] = []
    groups: list[list[_Item]] = []
    for it in order:
        for g in open_groups:
            if all(compatible(it, other) for other in g):
                g.append(it)
                if len(g) == k:
                    groups.append(g)
                    open_groups.remove(g)
                break
        else:
            open_groups.append([it])
        if len(groups) == n_groups:
            break
    return groups


def _group_docs(
    rng: random.Random, groups: list[list[_Item]], extra: Callable[[_Item], dict[str, Any]]
) -> list[dict[str, Any]]:
    """Every document of a group gets the same choices (the group's answers) in the same seeded order: each choice
    is the right answer exactly once per group, so any scorer that ignores the story (a prior over names or
    sentences, a favourite position) scores exactly 1/k on whole groups. Groups are contiguous (for --limit)."""
    docs = []
    for g in groups:
        choices = [it.answer for it in g]
        rng.shuffle(choices)
        for it in g:
            docs.append(
                {
                    "context": it.context,
                    "choices": choices,
                    "label": choices.index(it.answer),
                    "story_idx": it.story_idx,
                    **extra(it),
                }
            )
    return docs


def make_ending_docs(
    stories: Sequence[str], n_docs: int = DEFAULT_DOCS, seed: int = TASK_SEED, n_choices: int = 4
) -> list[dict[str, Any]]:
    """The story without its last sentence; choices: the last sentences of a group of n_choices stories (all
    different), the story's own among them. About n_docs documents (whole groups)."""
    rng = random.Random(f"tinystories_ending:{seed}")
    items = []
    for i, s in enumerate(stories):
        split = last_sentence_split(s)
        if split is not None and _ending_ok(*split):
            items.append(_Item(story_idx=i, context=split[0], answer=split[1], story=s))
    groups = _balanced_groups(rng, items, n_choices, -(-n_docs // n_choices), lambda a, b: a.answer != b.answer)
    return _group_docs(rng, groups, lambda it: {})


def _mentions(name: str, text: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", text) is not None


def make_names_docs(
    stories: Sequence[str], n_docs: int = DEFAULT_DOCS, seed: int = TASK_SEED, n_choices: int = 4
) -> list[dict[str, Any]]:
    """The story up to the protagonist's next mention after its introduction; choices: the protagonists of a group
    of n_choices stories with different protagonists, none of which occurs in another story of the group (so the
    context never contains a wrong name). About n_docs documents (whole groups)."""
    rng = random.Random(f"tinystories_names:{seed}")
    items = []
    for i, s in enumerate(stories):
        story = s.strip()
        found = find_protagonist(story)
        if found is None:
            continue
        name, intro = found
        after = intro + len(name)
        nxt = re.search(rf"\b{re.escape(name)}\b", story[after:])
        if nxt is None:
            continue
        items.append(_Item(story_idx=i, context=story[: after + nxt.start()], answer=name, story=story))
    groups = _balanced_groups(
        rng,
        items,
        n_choices,
        -(-n_docs // n_choices),
        lambda a, b: a.answer != b.answer and not _mentions(a.answer, b.story) and not _mentions(b.answer, a.story),
    )
    return _group_docs(rng, groups, lambda it: {"name": it.answer})


# The words that move in tinystories_order: articles, prepositions that cannot be verb particles, auxiliaries and
# modals, personal pronouns (not "her", which is also a determiner), coordinating and subordinating conjunctions.
SWAP_WORDS = frozenset(
    """
a an the
to of with for at from into onto
is are was were am has have had do does did will would can could should must
he she it they we you him them me us
and but or because if
""".split()
)
# Words that are neither: the rest of the closed classes, the adverbs that can stand in several places (a pair with
# one of these could be reordered grammatically: "she was always" -> "she always was"), and "close", whose
# "was close to the park" would become the grammatical "was to close the park". Never swapped.
NOT_CONTENT = SWAP_WORDS | frozenset(
    """
this that these those her his my your our their its some any no every each all both many much more most few such
what which who whom whose where when why how than as while until since though although unless whether so yet nor
up down out off on in over under away back around through about by along across after before behind near inside
outside between upon without not never always often still again also too very just only even then there here now
soon once today tomorrow yesterday later together home ever already almost quite really well maybe perhaps
be been being shall may might i myself himself herself itself themselves yourself ourselves one everyone everything
someone something anyone anything nobody nothing everywhere somewhere let lets close
""".split()
)
_ORDER_WORD = re.compile(r"[a-z]+")
_ORDER_SENTENCE = re.compile(r"[A-Z][a-z]*(?:'[a-z]+)?,?(?: [A-Za-z]+(?:'[a-z]+)?,?)+\.")


def order_pairs(sentence: str) -> list[int]:
    """Positions i where words i-1 and i of `sentence` may be swapped for tinystories_order (see `make_order_docs`).

    Word i is in `SWAP_WORDS`, word i-1 is an open-class word (lowercase letters only, not in `NOT_CONTENT`, not an
    -ly adverb); both are bare (no punctuation attached) and word i-1 is not the first word, so the swap moves no
    comma, full stop or capital letter. Empty when the sentence itself is not eligible: a single line of plain words
    (letters, in-word apostrophes, commas) ending in a full stop — no dialogue, digits or odd characters, so the
    task never asks about punctuation, and declarative, so an inverted auxiliary never reads as a question."""
    if not _ORDER_SENTENCE.fullmatch(sentence):
        return []
    words = sentence.split(" ")
    if not 5 <= len(words) <= 25:
        return []
    return [
        i
        for i in range(2, len(words))
        if words[i] in SWAP_WORDS
        and _ORDER_WORD.fullmatch(words[i - 1])
        and words[i - 1] not in NOT_CONTENT
        and not words[i - 1].endswith("ly")
    ]


def swap_words(sentence: str, i: int) -> str:
    """`sentence` with words i-1 and i exchanged (single spaces, as eligible sentences have)."""
    words = sentence.split(" ")
    words[i - 1], words[i] = words[i], words[i - 1]
    return " ".join(words)


def make_order_docs(stories: Sequence[str], n_docs: int = DEFAULT_DOCS, seed: int = TASK_SEED) -> list[dict[str, Any]]:
    """Minimal pairs of local word order: a validation sentence against the same sentence with a function word moved
    in front of the open-class word before it ("the dog was happy" -> "the was dog happy"). About n_docs documents
    (an even number), at most one per story.

    Why the swapped sentence is ungrammatical: English puts an article before its noun phrase, a preposition before
    its object, an auxiliary after its subject and before its verb, an object pronoun after its verb, a subject
    pronoun before its verb, and a conjunction between the things it joins; moving such a word in front of the
    open-class word that precedes it breaks that order ("she the saw dog", "she to went the park", "the was dog
    happy", "Tom him saw", "he and ran jumped"). Swaps that English allows are kept out by construction: the other
    closed-class words, particles ("picked up toys" / "picked toys up") and movable adverbs ("was always" / "always
    was") are never swapped, and only declarative sentences are used.

    Both choices are the same words (the same multiset of whitespace-separated words, by construction; with the
    whitespace-bounded pieces of a SentencePiece tokenizer also the same tokens), so a scorer that ignores word order
    gives both the same log-likelihood. The original is the first choice in exactly one document of every
    consecutive pair (seeded which one), and lm-eval breaks a tie towards the first choice, so such a scorer gets
    exactly 1/2 on whole pairs of documents, and any order-blind scorer 1/2 in expectation.
    The whole sentence is scored with an empty context (the model sees only the sentence: the task is local syntax).
    """
    rng = random.Random(f"tinystories_order:{seed}")
    order = list(range(len(stories)))
    rng.shuffle(order)
    n_docs += n_docs % 2
    docs: list[dict[str, Any]] = []
    for idx in order:
        story = stories[idx].strip()
        ends = [0] + [m.end() for m in _SENT_END.finditer(story)] + [len(story)]
        sentences = [story[a:b].strip() for a, b in zip(ends, ends[1:])]
        eligible = [(k, s) for k, s in enumerate(sentences) if order_pairs(s)]
        if not eligible:
            continue
        k, sentence = rng.choice(eligible)
        i = rng.choice(order_pairs(sentence))
        docs.append(
            {
                "sentence": sentence,
                "swapped": swap_words(sentence, i),
                "position": i,
                "sentence_idx": k,
                "story_idx": idx,
            }
        )
        if len(docs) == n_docs:
            break
    docs = docs[: len(docs) - len(docs) % 2]
    for j in range(0, len(docs), 2):
        first = rng.randrange(2)
        for d, label in ((docs[j], first), (docs[j + 1], 1 - first)):
            d["choices"] = [d["sentence"], d["swapped"]] if label == 0 else [d["swapped"], d["sentence"]]
            d["label"] = label
    return docs


GENERATORS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "tinystories_ppl": make_ppl_docs,
    "tinystories_ending": make_ending_docs,
    "tinystories_names": make_names_docs,
    "tinystories_order": make_order_docs,
}


@dataclass(frozen=True)
class BundledTasks:
    dir: Path  # include_path for lm-eval's TaskManager
    versions: dict[str, str]  # task -> stored task_version
    n_docs: dict[str, int]


def build_bundled_tasks(
    prepared: datamod.Prepared,
    tasks: Sequence[str] = BUNDLED_TASKS,
    *,
    n_docs: int = DEFAULT_DOCS,
    seed: int = TASK_SEED,
) -> BundledTasks:
    """Generate the documents of `tasks` from the validation split and write loadable lm-eval YAMLs beside them.

    Deterministic: the same validation stories, n_docs and seed give byte-identical files. Rewritten every call
    (cheap), atomically, so concurrent evaluations never read a half-written file.
    """
    unknown = [t for t in tasks if t not in GENERATORS]
    if unknown:
        raise ConfigError(f"not a bundled task: {', '.join(unknown)}; bundled: {', '.join(BUNDLED_TASKS)}")
    out_dir = prepared.dir / TASKS_SUBDIR
    out_dir.mkdir(parents=True, exist_ok=True)
    stories = prepared.valid_stories()
    versions, counts = {}, {}
    for task in tasks:
        docs = GENERATORS[task](stories, n_docs=n_docs, seed=seed)
        if not docs:
            raise EvalError(
                f"{task}: no usable documents in the {len(stories)} validation stories of "
                f"{prepared.dir}; use a larger validation split (data.max_valid_stories)"
            )
        body = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs)
        digest = hashlib.sha256(body.encode("utf-8")).hexdigest()
        data_path = out_dir / f"{task}.jsonl"
        atomic_write(data_path, body)
        atomic_write(
            out_dir / f"{task}.yaml",
            _render_yaml(task, data_path, out_dir, seed, len(docs), digest, prepared.fingerprint),
        )
        versions[task] = f"{TASK_VERSIONS[task]}+{digest[:12]}"
        counts[task] = len(docs)
    return BundledTasks(dir=out_dir, versions=versions, n_docs=counts)


def _render_yaml(
    task: str, data_path: Path, out_dir: Path, seed: int, n_docs: int, digest: str, fingerprint: str
) -> str:
    """The task's template with its absolute data path and the generator's version, seed and document hash."""
    cfg = yaml.safe_load((TEMPLATES / f"{task}.yaml").read_text(encoding="utf-8"))
    cfg["dataset_kwargs"] = {
        "data_files": {"test": str(data_path.resolve())},
        "cache_dir": str((out_dir / "hf_datasets").resolve()),  # datasets' arrow cache stays in benchctl's cache
    }
    cfg["metadata"] = {
        **(cfg.get("metadata") or {}),
        "version": float(TASK_VERSIONS[task]),
        "generator": f"benchctl.stages.eval.api.{task}",
        "seed": seed,
        "n_docs": n_docs,
        "docs_sha256": digest,
        "data_fingerprint": fingerprint,
    }
    header = f"# Generated by benchctl (template benchctl/tasks/{task}.yaml); regenerated on every `benchctl eval`.\n"
    return header + yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True)


# ====================================================================================================================
# Finding tasks: bundled, the user's include paths, lm-eval's own


class TaskIndex:
    """The lm-eval TaskManager for one prepared data directory: the bundled tasks generated into it, the user's
    include paths, and lm-eval's own tasks only when a requested name is not found in those (indexing lm-eval's
    many thousands of task entries is slow)."""

    def __init__(
        self,
        prepared: datamod.Prepared,
        bundled: list[str],
        standard: list[str],
        n_docs: int,
        include_paths: Sequence[Path],
    ):
        self.bundled = build_bundled_tasks(prepared, bundled, n_docs=n_docs) if bundled else None
        paths = ([str(self.bundled.dir)] if self.bundled else []) + [str(Path(p).resolve()) for p in include_paths]
        self.tm = TaskManager(include_path=paths or None, include_defaults=False)
        missing = [t for t in bundled if t not in self.tm.all_tasks]
        if missing:  # lm-eval skips a YAML it cannot parse without a word
            raise EvalError(
                f"lm-eval did not find the generated task(s) {', '.join(missing)} in "
                f"{self.bundled.dir if self.bundled else '-'}; the YAML there does not parse — delete "
                "the directory and rerun"
            )
        if any(not _matches(self.tm, name) for name in standard):
            self.tm = TaskManager(include_path=paths or None, include_defaults=True)

    def versions(self) -> dict[str, str]:
        return dict(self.bundled.versions) if self.bundled else {}

    def resolve(self, names: list[str]) -> list[str]:
        """Expand globs (blimp_*) against lm-eval's index; unknown names are a ConfigError with a suggestion."""
        out: list[str] = []
        for name in names:
            matched = _matches(self.tm, name)
            if not matched:
                hint = did_you_mean(name, list(BUNDLED_TASKS) + self.tm.all_tasks)
                raise ConfigError(
                    f"unknown task '{name}'{hint} (bundled: {', '.join(BUNDLED_TASKS)}; or any lm-eval "
                    "task name, e.g. hellaswag, lambada_openai, blimp_*)"
                )
            out += [m for m in matched if m not in out]
        return out


def _matches(tm, name: str) -> list[str]:
    if any(c in name for c in "*?["):
        return tm.match_tasks([name])
    return [name] if name in tm.all_tasks else []
