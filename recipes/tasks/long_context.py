"""Procedurally generated, seeded long-context tasks for RLM agents (no downloads).

The context is *not* in the prompt: the prompt is the query alone, and the context -- a str, or a
list of str with ``context_format="list"`` -- travels in ``extra_info["context"]`` for the RLM env
to load into the REPL. Lengths are in characters (``len(context)``, or the sum of the item lengths
for a list), drawn per problem from the ``lengths`` knob: ``"8000,64000"``, ``"8K,1M"``
(K = 1,000, M = 1,000,000), or a sequence of ints. S-NIAH contexts land within a few characters
of the requested length; OOLONG contexts within one line (about 100 characters) below it.

Row layout (verl columns): ``data_source``; ``prompt`` = ``[{"role": "user", "content": query}]``
(the RLM env adds its system prompt, ``workers.rlm.prompts``); ``ability`` = ``"long_context"``;
``reward_model`` = ``{"ground_truth": ..., "style": "rule"}``; ``extra_info`` with ``split``,
``index``, ``question``, ``context``, ``context_type`` (``"str"``/``"list"``), ``context_length``,
``n_items`` (1 for a str), ``requested_length``, ``answer_type`` (``exact``, ``numeric``,
``categorical``, ``pairs``), ``reference_turns``, ``solution``, ``final_style`` and per-task fields
(S-NIAH: ``needle``, ``needle_key``, ``needle_depth``; OOLONG: ``query_type``, ``label``, ``user``,
``label_mode``, ``n_lines``; pairs: ``condition``, ``condition_text``, ``label_mode``, ``n_lines``,
``n_users``).

Tasks (``GENERATORS``; registered in ``recipes.tasks.LONG_CONTEXT_TASKS``):

``sniah`` -- single needle in a haystack (``hyflow/sniah``). Filler is seeded synthetic prose (no
    digits, never the words of the needle), with one needle sentence ``The special magic number for
    <adjective>-<noun> is <7 digits>.`` at a random depth between ``needle_depth_min`` and
    ``needle_depth_max`` (``n_distractors`` adds needles for other keys). Query: the number for the
    key. Ground truth: the 7-digit string. Train and validation keys are disjoint.

``oolong`` -- aggregation over labelled lines (``hyflow/oolong``), one line per instance::

    Date: Mar 04, 2023 || User: 48213 || Instance: How many owls live in Tarnwick?

    Each instance is a question whose category (``abbreviation``, ``description``, ``entity``,
    ``location``, ``numeric``, ``person``) is determined by how it starts (``CUES``: "How many " ->
    numeric, "Where " -> location, ...; no cue is a prefix of another). ``label_mode="explicit"``
    appends ``|| Label: <category>``; ``"implicit"`` (default) leaves it to be inferred. Queries
    (``query_types``): ``count`` (instances of category X), ``count_user`` (instances of category X
    from user U) -- numeric, scored ``0.75 ** abs(error)`` -- and ``most_common`` / ``least_common``
    category (unique by construction) -- exact match. The reference solution (``program``) parses every
    line in three turns (``stepwise``) or, with explicit labels, counts the labels in one (``compact``);
    ``sloppy_frac`` of the rows get one that aggregates only the first ``sloppy_lines`` lines instead.

``oolong_pairs`` -- pairs of users (``hyflow/oolong_pairs``): the same kind of lines; the query
    asks for every pair of user ids satisfying a condition on the two users' category counts
    (``conditions``: ``both_has``, ``both_lacks``, ``both_more``, ``both_at_least``, ``exactly_one``).
    Ground truth: the sorted list of ``[low, high]`` pairs (between ``min_pairs`` and
    ``max_pairs`` of them); scored by F1 over the set of pairs.

Every row carries a reference RLM solution in ``extra_info["reference_turns"]`` (assistant turns:
prose plus ```repl blocks, the last one finishing with FINAL/FINAL_VAR; ``final_style`` picks
``var_line`` = ``FINAL_VAR(answer)`` on its own line, ``code`` = ``FINAL(answer)`` in the block,
or ``literal_line`` = the answer printed, then ``FINAL(<answer>)`` on its own line in a further
turn) -- plain Python over ``context`` that reproduces the ground truth, for warm starts.
``extra_info["solution"]`` joins the turns with blank lines.

    python -m recipes.tasks.make --task sniah --lengths 8000,64000 --out data/sniah --train 200 --val 50
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import itertools
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from workers.reward.long_context import OOLONG, OOLONG_PAIRS, SNIAH

__all__ = [
    "CUES",
    "GENERATORS",
    "LABELS",
    "OolongConfig",
    "OolongPairsConfig",
    "SNIAHConfig",
    "classify_instance",
    "context_length",
    "parse_lengths",
]

ABILITY = "long_context"
MIN_LENGTH = 1000
FINAL_STYLES = ("var_line", "code", "literal_line")

# --------------------------------------------------------------------------------------------------
# Vocabulary (hand-written for this module; no digits, no "magic"/"special"/"number")

_ADJ = (
    "amber brave bright broad calm careful clever cold copper crisp curious dark deep distant dry "
    "dusty eager early empty faint fair famous fast fierce gentle gilded golden grand green grey "
    "hidden hollow humble icy idle jolly keen kind late lazy lively lone loud lucky mellow mild "
    "misty modest narrow neat noble odd old pale patient plain polite proud quick quiet rapid rare "
    "restless rough round rusty sandy scarlet sharp shy silent silver simple sleepy slow small "
    "smooth soft solid sour steady stern still stormy strange sturdy sunny swift tall tender thin "
    "tidy tiny tired vast velvet warm wary weary wide wild windy wise wooden young"
).split()
_NOUN = (
    "anchor apple arch badger banner barn basket beacon bell bench birch boat bridge brook bucket "
    "cabin candle canyon carpet castle cedar chapel cliff cloak clock cloud comet cottage crane "
    "creek crow desk dove drum eagle engine falcon feather fence fern ferry field flag forest fox "
    "garden gate glacier goat harbor hawk hedge heron hill hive horn island kettle ladder lake "
    "lantern ledge lily map maple marsh meadow mill mirror moon moth mountain oak orchard otter owl "
    "paddle path pebble pier pine pond quarry raven reef ridge river robin saddle sail shell shore "
    "sparrow spire spring stable star stone stove tower trail valley violin wagon whale willow wolf"
).split()
_VERB = (
    "admired avoided borrowed carried chased circled cleaned crossed described followed found "
    "gathered guarded helped hid joined kept lifted mended moved noticed opened painted passed "
    "pulled pushed reached repaired sheltered showed sketched studied touched traced visited "
    "warmed watched weighed"
).split()
_VERB_BASE = (
    "bend drift float fold glow grow hum melt rest ripple rust shine sink spin swell turn wander"
).split()
_ADV = "briefly calmly gladly gently often quietly rarely slowly softly warmly".split()
_PREP = "near beside behind above below across beyond past under".split()
_SYLLABLES = (
    "ash bel bran cor dun el fen gar hol ind jor kel lin mar nor orm pel quen ros sal tar ul ven wick yar zen"
).split()
_PLACE_END = "ford moor ton wick dale holm by stead mere gate".split()
_MONTHS = "Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split()
_KEY_ADJ, _KEY_NOUN = _ADJ, _NOUN  # needle keys: "<adj>-<noun>"; hyphenated pairs never occur in filler


def parse_lengths(spec: str | int | Sequence[int]) -> tuple[int, ...]:
    """``"8000,64000"`` / ``"8K,1M"`` / ``8000`` / ``[8000, 64000]`` -> ``(8000, 64000)``."""
    if isinstance(spec, int):
        return (spec,)
    if not isinstance(spec, str):
        return tuple(int(x) for x in spec)
    out = []
    for item in spec.replace(" ", "").split(","):
        if not item:
            continue
        m = re.fullmatch(r"(\d[\d_]*)([kKmM]?)", item)
        if not m:
            raise ValueError(f"bad length {item!r}: use integers with an optional K (1e3) or M (1e6)")
        out.append(int(m.group(1).replace("_", "")) * {"": 1, "k": 1000, "m": 1_000_000}[m.group(2).lower()])
    return tuple(out)


def context_length(context: str | Sequence[str]) -> int:
    return len(context) if isinstance(context, str) else sum(len(x) for x in context)


def _sub_rng(rng: random.Random) -> random.Random:
    return random.Random(rng.getrandbits(64))


def _digest(*parts: Any) -> str:
    h = hashlib.sha1()
    for p in parts:
        h.update(("\x00".join(p) if isinstance(p, list) else str(p)).encode())
        h.update(b"\x01")
    return h.hexdigest()


@dataclass
class _Common:
    lengths: str = "8000,16000,32000"
    context_format: str = "str"  # "str" or "list"
    final_style: str = "var_line"  # how the reference solution finishes (FINAL_STYLES)

    def __post_init__(self) -> None:
        if not isinstance(self.lengths, str):
            self.lengths = ",".join(str(x) for x in parse_lengths(self.lengths))

    @property
    def length_values(self) -> tuple[int, ...]:
        return parse_lengths(self.lengths)

    def validate(self) -> None:
        lengths = self.length_values
        if not lengths or min(lengths) < MIN_LENGTH:
            raise ValueError(f"lengths must be non-empty and each >= {MIN_LENGTH}, got {self.lengths!r}")
        if self.context_format not in ("str", "list"):
            raise ValueError(f"context_format must be 'str' or 'list', got {self.context_format!r}")
        if self.final_style not in FINAL_STYLES:
            raise ValueError(f"final_style must be one of {FINAL_STYLES}, got {self.final_style!r}")


# --------------------------------------------------------------------------------------------------
# Reference solutions


def _finish(style: str, lead: str, code: str, answer: str) -> list[str]:
    """The last reference turn(s): ``code`` computes ``answer`` (the variable) in a repl block."""
    block = f"{lead}\n```repl\n{code}\n"
    if style == "var_line":
        return [block + "print(answer)\n```\nFINAL_VAR(answer)"]
    if style == "code":
        return [block + "print(answer)\nFINAL(answer)\n```"]
    return [block + "print(answer)\n```", f"The answer printed above is what I report.\nFINAL({answer})"]


def _row(
    data_source: str,
    question: str,
    ground_truth: Any,
    context: str | list[str],
    split: str,
    index: int,
    cfg: _Common,
    turns: list[str],
    answer_type: str,
    requested_length: int,
    **info: Any,
) -> dict:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": question}],
        "ability": ABILITY,
        "reward_model": {"ground_truth": ground_truth, "style": "rule"},
        "extra_info": {
            "split": split,
            "index": index,
            "question": question,
            "context": context,
            "context_type": "str" if isinstance(context, str) else "list",
            "context_length": context_length(context),
            "n_items": 1 if isinstance(context, str) else len(context),  # a str is one item
            "requested_length": requested_length,
            "answer_type": answer_type,
            "reference_turns": turns,
            "solution": "\n\n".join(turns),
            "final_style": cfg.final_style,
            **info,
        },
    }


# --------------------------------------------------------------------------------------------------
# S-NIAH


@dataclass
class SNIAHConfig(_Common):
    lengths: str = "8000,16000,32000,64000"
    needle_depth_min: float = 0.0  # needle position as a fraction of the context
    needle_depth_max: float = 1.0
    n_distractors: int = 0  # needles for other keys
    item_chars: int = 2000  # context_format="list": about this many characters per item
    # how the reference solution searches: "key" -- a regex with the asked key (the model must copy it from
    # the question); "pattern" -- every magic-number sentence, then the only hit (no distractors; a program
    # small models learn without copying, e.g. the CPU recipe's warm start)
    search: str = "key"
    key_words: int = 0  # > 0: keys from the first k adjectives x k nouns only (k*k keys; easier to copy)
    # decoys: sentences that name the asked key next to a wrong seven-digit number, phrased so that neither
    # reference regex matches them; they defeat the shortcut "take the first seven-digit number"
    n_decoys: int = 0
    # fraction of rows whose reference solution takes that shortcut (right only when the needle comes
    # first): an imperfect teacher, so RL has a better program to find (cf. the quickstart's arith_mixed)
    sloppy_frac: float = 0.0

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.key_words <= min(len(_KEY_ADJ), len(_KEY_NOUN)):
            raise ValueError(
                f"key_words must be in [0, {min(len(_KEY_ADJ), len(_KEY_NOUN))}], got {self.key_words}"
            )
        if self.key_words and self.key_words**2 <= self.n_distractors:
            raise ValueError(
                f"key_words={self.key_words} gives too few keys for {self.n_distractors} distractors"
            )
        if self.search not in ("key", "pattern"):
            raise ValueError(f"search must be 'key' or 'pattern', got {self.search!r}")
        if self.search == "pattern" and self.n_distractors:
            raise ValueError("search='pattern' finds every needle: it needs n_distractors=0")
        if not 0.0 <= self.needle_depth_min <= self.needle_depth_max <= 1.0:
            raise ValueError("need 0 <= needle_depth_min <= needle_depth_max <= 1")
        if not 0 <= self.n_distractors <= 50:
            raise ValueError(f"n_distractors must be in [0, 50], got {self.n_distractors}")
        if self.item_chars < 200:
            raise ValueError(f"item_chars must be >= 200, got {self.item_chars}")
        if not 0 <= self.n_decoys <= 10:
            raise ValueError(f"n_decoys must be in [0, 10], got {self.n_decoys}")
        if not 0.0 <= self.sloppy_frac <= 1.0:
            raise ValueError(f"sloppy_frac must be in [0, 1], got {self.sloppy_frac}")


def _sentence(rng: random.Random) -> str:
    c = rng.choice
    kind = rng.randrange(6)
    if kind == 0:
        s = f"the {c(_ADJ)} {c(_NOUN)} {c(_VERB)} the {c(_NOUN)} {c(_PREP)} the {c(_ADJ)} {c(_NOUN)}"
    elif kind == 1:
        s = f"a {c(_NOUN)} {c(_VERB)} {c(_ADV)} {c(_PREP)} the {c(_NOUN)}"
    elif kind == 2:
        s = f"every {c(_ADJ)} {c(_NOUN)} in the {c(_NOUN)} {c(_VERB)} a {c(_ADJ)} {c(_NOUN)}"
    elif kind == 3:
        s = f"{c(_ADJ)} {c(_NOUN)}s {c(_VERB_BASE)} {c(_ADV)} when the {c(_NOUN)} is {c(_ADJ)}"
    elif kind == 4:
        s = f"nobody {c(_VERB)} the {c(_NOUN)} until the {c(_ADJ)} {c(_NOUN)} {c(_VERB)} it"
    else:
        s = f"the {c(_NOUN)} and the {c(_NOUN)} {c(_VERB)} each {c(_NOUN)} {c(_PREP)} the {c(_NOUN)}"
    return s[0].upper() + s[1:] + "."


def _words_sentence(rng: random.Random, max_chars: int) -> str:
    """A sentence of at most ``max_chars`` characters (empty when too few are left)."""
    words: list[str] = []
    size = 0  # of " ".join(words) + "."
    for _ in range(100):
        w = rng.choice(_NOUN + _ADJ)
        grown = size + len(w) + 1  # a separator (or, for the first word, the final period)
        if grown > max_chars:
            break
        words.append(w)
        size = grown
    if not words:
        return ""
    s = " ".join(words)
    return s[0].upper() + s[1:] + "."


def _fill_sentences(rng: random.Random, target: int) -> list[str]:
    """Sentences whose ``" ".join`` is at most ``target`` characters and within a few of it."""
    out: list[str] = []
    size = -1  # the join adds len(out) - 1 separators
    while True:
        s = _sentence(rng)
        if size + 1 + len(s) > target:
            break
        out.append(s)
        size += 1 + len(s)
    tail = _words_sentence(rng, target - size - 1)
    if tail:
        out.append(tail)
    return out


def _group(sentences: list[str], item_chars: int) -> list[str]:
    items, cur, size = [], [], 0
    for s in sentences:
        cur.append(s)
        size += len(s) + 1
        if size >= item_chars:
            items.append(" ".join(cur))
            cur, size = [], 0
    if cur:
        items.append(" ".join(cur))
    return items


def _needle(key: str, value: str) -> str:
    return f"The special magic number for {key} is {value}."


def _decoy(key: str, value: str) -> str:
    return f"An old note wrongly gave {value} as the special magic number for {key}."


def sample_sniah(rng: random.Random, cfg: SNIAHConfig) -> dict | None:
    length = rng.choice(cfg.length_values)
    adjs, nouns = (
        (_KEY_ADJ[: cfg.key_words], _KEY_NOUN[: cfg.key_words]) if cfg.key_words else (_KEY_ADJ, _KEY_NOUN)
    )
    key = f"{rng.choice(adjs)}-{rng.choice(nouns)}"
    value = str(rng.randint(1_000_000, 9_999_999))
    needles = [(key, value)]
    while len(needles) < 1 + cfg.n_distractors:
        k = f"{rng.choice(adjs)}-{rng.choice(nouns)}"
        v = str(rng.randint(1_000_000, 9_999_999))
        if all(k != nk and v != nv for nk, nv in needles):
            needles.append((k, v))
    texts = [_needle(k, v) for k, v in needles]
    numbers = {v for _, v in needles}
    while len(numbers) < len(needles) + cfg.n_decoys:
        v = str(rng.randint(1_000_000, 9_999_999))
        if v not in numbers:
            numbers.add(v)
            texts.append(_decoy(key, v))
    list_mode = cfg.context_format == "list"
    # for a list the item joins are not counted, so aim at the length plus the item separators
    extra = length // cfg.item_chars if list_mode else 0
    sub = _sub_rng(rng)
    filler = _fill_sentences(sub, length + extra - sum(len(t) + 1 for t in texts))
    depth = rng.uniform(cfg.needle_depth_min, cfg.needle_depth_max)
    slots = [round(depth * len(filler))] + [rng.randint(0, len(filler)) for _ in texts[1:]]
    for pos, text in sorted(zip(slots, texts), key=lambda p: -p[0]):  # back to front keeps positions
        filler.insert(pos, text)
    context: str | list[str] = _group(filler, cfg.item_chars) if list_mode else " ".join(filler)
    joined = context if isinstance(context, str) else "\n".join(context)
    offset = joined.index(texts[0])
    return {
        "key": ("sniah", key, value),  # distinct problems: the key alone repeats under key_words
        "needle_key": key,
        "answer": value,
        "context": context,
        "length": length,
        "needle": texts[0],
        "needle_depth": offset / max(1, len(joined)),
    }


def make_sniah_row(prob: dict, split: str, index: int, demo_rng: random.Random, cfg: SNIAHConfig) -> dict:
    key, value = prob["needle_key"], prob["answer"]
    question = (
        f"What is the special magic number for {key} mentioned in the context? Answer with the number only."
    )
    fmt = "string" if isinstance(prob["context"], str) else "list of text chunks"
    search = "sloppy" if cfg.sloppy_frac and demo_rng.random() < cfg.sloppy_frac else cfg.search
    if search == "sloppy":  # the first seven-digit number: wrong when a decoy comes before the needle
        target, regex, pick = "a seven-digit number", r"\d{7}", "hits[0]"
    elif search == "key":
        target, regex, pick = (
            f"the sentence about {key}",
            rf"special magic number for {key} is (\d+)",
            "hits[0]",
        )
    else:  # every needle; with no distractors the only one
        target, regex, pick = (
            "the magic number sentence",
            r"special magic number for ([\w-]+) is (\d+)",
            "hits[0][1]",
        )
    first = (
        f"The context is a {fmt} of about {prob['length']:,} characters, too long to read, so I search "
        f"it for {target}.\n```repl\nimport re\n\n"
        'text = context if isinstance(context, str) else "\\n".join(context)\n'
        f'hits = re.findall(r"{regex}", text)\n'
        "print(len(text), hits)\n```"
    )
    turns = [first] + _finish(
        cfg.final_style, "The needle occurs once; its number is the answer.", f"answer = {pick}", value
    )
    return _row(
        SNIAH, question, value, prob["context"], split, index, cfg, turns, "exact", prob["length"],
        needle=prob["needle"], needle_key=key, needle_depth=prob["needle_depth"], reference_search=search,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# OOLONG-style labelled lines

LABELS = ("abbreviation", "description", "entity", "location", "numeric", "person")

# (label, cue, tails): an instance is cue + tail; the cue alone decides the label
_TEMPLATES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("numeric", "How many ", ("{noun}s live in {place}?", "{noun}s did the {adj} {noun2} count?")),
    ("numeric", "How much ", ("does a {adj} {noun} weigh?", "salt does the {noun} of {place} use?")),
    ("numeric", "What year ", ("was the {adj} {noun} of {place} built?", "did {place} open its {noun}?")),
    ("numeric", "How long ", ("is the {adj} {noun} bridge in {place}?",)),
    ("numeric", "How far ", ("is {place} from {place2}?",)),
    ("location", "Where ", ("is the {adj} {noun} kept?", "did the {noun} of {place} come from?")),
    ("location", "In which country ", ("is {place} found?",)),
    ("location", "What city ", ("hosts the {adj} {noun} fair?",)),
    ("location", "Which river ", ("runs past {place}?",)),
    ("person", "Who ", ("invented the {adj} {noun}?", "wrote the tale of the {noun} of {place}?")),
    ("person", "Which scientist ", ("studied the {adj} {noun}s?",)),
    ("person", "Whose ", ("portrait hangs in the {noun} hall of {place}?",)),
    ("entity", "What animal ", ("is called the {adj} {noun}?",)),
    ("entity", "What kind of ", ("{noun} grows near {place}?",)),
    ("entity", "Which instrument ", ("sounds like a {adj} {noun}?",)),
    ("entity", "Name a ", ("{noun} that is {adj}.",)),
    ("description", "Why ", ("is the {noun} of {place} so {adj}?", "do {noun}s {verb} at dusk?")),
    ("description", "How does ", ("a {noun} {verb}?",)),
    ("description", "What is the meaning of ", ("the word {word}?",)),
    ("description", "Describe ", ("the {adj} {noun} of {place}.",)),
    ("abbreviation", "What does ", ("{acr} stand for?",)),
    ("abbreviation", "What is the full form of ", ("{acr}?",)),
    ("abbreviation", "Expand the abbreviation ", ("{acr}.",)),
)
CUES: tuple[tuple[str, str], ...] = tuple((cue, label) for label, cue, _ in _TEMPLATES)
_BY_LABEL = {lab: [(cue, tails) for lb, cue, tails in _TEMPLATES if lb == lab] for lab in LABELS}
_LINE_RE = r"^Date: (.+?) \|\| User: (\d+) \|\| Instance: (.+?)(?: \|\| Label: (\w+))?$"


def classify_instance(question: str) -> str | None:
    """The category of an instance question (by its cue), or None."""
    for cue, label in CUES:
        if question.startswith(cue):
            return label
    return None


def _place(rng: random.Random) -> str:
    return (rng.choice(_SYLLABLES) + rng.choice(_SYLLABLES) + rng.choice(_PLACE_END)).capitalize()


def _instance(rng: random.Random, label: str) -> str:
    cue, tails = rng.choice(_BY_LABEL[label])
    c = rng.choice
    slots = {
        "noun": c(_NOUN),
        "noun2": c(_NOUN),
        "adj": c(_ADJ),
        "verb": c(_VERB_BASE),
        "place": _place(rng),
        "place2": _place(rng),
        "word": c(_SYLLABLES) + c(_SYLLABLES) + c(("a", "o", "is", "en")),
        "acr": "".join(rng.choice("ABCDEFGHJKLMNPRSTVW") for _ in range(rng.randint(3, 4))),
    }
    return cue + c(tails).format(**slots)


@dataclass
class _Records:
    lines: list[str]
    users: list[int]  # per line
    labels: list[str]  # per line


def _date(rng: random.Random) -> str:
    d = _dt.date(2021, 1, 1) + _dt.timedelta(days=rng.randrange(4 * 365))
    return f"{_MONTHS[d.month - 1]} {d.day:02d}, {d.year}"


def _records(rng: random.Random, length: int, n_users: int, explicit: bool, list_mode: bool) -> _Records:
    """Lines of about ``length`` characters in all (joined by newlines, or summed for a list)."""
    global_w = {lab: rng.uniform(0.3, 1.0) for lab in LABELS}
    ids = rng.sample(range(10_000, 100_000), n_users)
    prefs: dict[int, list[float]] = {}
    for u in ids:
        w = [global_w[lab] * rng.uniform(0.3, 1.7) * (rng.random() > 0.2) for lab in LABELS]
        if sum(x > 0 for x in w) < 2:
            w = [global_w[lab] for lab in LABELS]
        prefs[u] = w
    out = _Records([], [], [])
    sep = 0 if list_mode else 1
    size = -sep
    misses = 0
    while misses < 40:
        u = rng.choice(ids)
        lab = rng.choices(LABELS, weights=prefs[u])[0]
        line = f"Date: {_date(rng)} || User: {u} || Instance: {_instance(rng, lab)}"
        if explicit:
            line += f" || Label: {lab}"
        if size + sep + len(line) > length:
            misses += 1  # try a few more lines that may still fit
            continue
        out.lines.append(line)
        out.users.append(u)
        out.labels.append(lab)
        size += sep + len(line)
    return out


def _explore_turn(explicit: bool) -> str:
    how = (
        "Each line ends with its label."
        if explicit
        else "The category is not written down, so I will decide it from how each question starts."
    )
    return (
        f"Let me look at how the context is laid out. {how}\n```repl\n"
        "lines = context if isinstance(context, list) else context.splitlines()\n"
        "print(len(lines))\nfor line in lines[:3]:\n    print(line)\n```"
    )


def _parse_code(explicit: bool, head: int = 0) -> str:
    """Reference code: ``rows`` = (user, category) for every line of ``lines`` (the first ``head`` only when
    ``head`` > 0: a sloppy demonstration)."""
    code = "import re\nfrom collections import Counter, defaultdict\n\n"
    if explicit:
        label_expr = "m.group(4)"
    else:
        cues = "".join(f"    ({cue!r}, {label!r}),\n" for cue, label in CUES)
        code += (
            f"CUES = [\n{cues}]\n\n\n"
            "def category(question):\n"
            "    for cue, label in CUES:\n"
            "        if question.startswith(cue):\n"
            "            return label\n"
            "    return None\n\n\n"
        )
        label_expr = "category(m.group(3))"
    return code + (
        "rows = []  # (user, category)\n"
        f"for line in lines{f'[:{head}]' if head else ''}:\n"
        f'    m = re.match(r"{_LINE_RE}", line)\n'
        "    if m:\n"
        f"        rows.append((int(m.group(2)), {label_expr}))\n"
        "print(len(rows), Counter(label for _, label in rows))\n"
    )


def _question_header(explicit: bool) -> str:
    where = (
        "its category is written at the end of the line after 'Label:'"
        if explicit
        else "the category is not written down: decide it from the question"
    )
    return (
        "Each line of the context is one instance: a date, a user id and a question. Every question "
        f"belongs to exactly one category among {', '.join(LABELS)}; {where}. "
    )


@dataclass
class OolongConfig(_Common):
    label_mode: str = "implicit"  # "implicit" (infer from the question) or "explicit" (|| Label: x)
    query_types: str = "count,count_user,most_common,least_common"
    lines_per_user: int = 12  # users = max(3, lines // lines_per_user)
    # the reference solution: "stepwise" -- look, parse every line into (user, category), aggregate (three
    # turns); "compact" -- one turn that counts the "|| Label:" fields (label_mode="explicit" only; a program
    # small enough for the tiny CPU model)
    program: str = "stepwise"
    # fraction of rows whose reference solution aggregates only the first ``sloppy_lines`` lines: an
    # imperfect teacher (right only when the head of the context agrees with the whole), so RL has a better
    # program to find (cf. S-NIAH's sloppy_frac)
    sloppy_frac: float = 0.0
    sloppy_lines: int = 10

    def validate(self) -> None:
        super().validate()
        if self.label_mode not in ("implicit", "explicit"):
            raise ValueError(f"label_mode must be 'implicit' or 'explicit', got {self.label_mode!r}")
        bad = set(self.query_type_list) - {"count", "count_user", "most_common", "least_common"}
        if not self.query_type_list or bad:
            raise ValueError(f"query_types: unknown or empty {sorted(bad)} in {self.query_types!r}")
        if self.lines_per_user < 1:
            raise ValueError("lines_per_user must be >= 1")
        if self.program not in ("stepwise", "compact"):
            raise ValueError(f"program must be 'stepwise' or 'compact', got {self.program!r}")
        if self.program == "compact" and self.label_mode != "explicit":
            raise ValueError("program='compact' counts the written labels: it needs label_mode='explicit'")
        if not 0.0 <= self.sloppy_frac <= 1.0:
            raise ValueError(f"sloppy_frac must be in [0, 1], got {self.sloppy_frac}")
        if self.sloppy_lines < 1:
            raise ValueError(f"sloppy_lines must be >= 1, got {self.sloppy_lines}")

    @property
    def query_type_list(self) -> list[str]:
        return [q for q in self.query_types.replace(" ", "").split(",") if q]


def sample_oolong(rng: random.Random, cfg: OolongConfig) -> dict | None:
    length = rng.choice(cfg.length_values)
    qtype = rng.choice(cfg.query_type_list)
    explicit = cfg.label_mode == "explicit"
    n_users = max(3, length // (90 * cfg.lines_per_user))
    rec = _records(_sub_rng(rng), length, n_users, explicit, cfg.context_format == "list")
    counts = Counter(rec.labels)
    label = user = None
    if qtype == "count":
        label = rng.choice(LABELS)
        answer = str(counts[label])
        ask = f"How many instances have the category '{label}'? Answer with a single integer."
    elif qtype == "count_user":
        label, user = rng.choice(LABELS), rng.choice(rec.users)
        answer = str(sum(1 for u, lab in zip(rec.users, rec.labels) if u == user and lab == label))
        ask = (
            f"How many instances from user {user} have the category '{label}'? Answer with a single integer."
        )
    else:
        ranked = sorted(LABELS, key=lambda lab: counts[lab], reverse=qtype == "most_common")
        if counts[ranked[0]] == counts[ranked[1]]:
            return None  # no unique answer
        answer = ranked[0]
        which = "most" if qtype == "most_common" else "least"
        ask = f"Which category is the {which} common among all instances? Answer with the category name only."
    context: str | list[str] = rec.lines if cfg.context_format == "list" else "\n".join(rec.lines)
    question = _question_header(explicit) + ask
    return {
        "key": ("oolong", _digest(question, context)),
        "question": question,
        "answer": answer,
        "query_type": qtype,
        "label": label,
        "user": user,
        "context": context,
        "length": length,
        "records": rec,
    }


def _oolong_aggregate(prob: dict, stepwise: bool) -> str:
    """Reference code that ends with ``answer``: from ``rows`` = (user, category) pairs (``stepwise``), or from
    ``counts``, a Counter of the categories already counted (compact)."""
    qtype, label, user = prob["query_type"], prob["label"], prob["user"]
    if qtype in ("count", "count_user"):
        mine = "u, label in rows if u == " + str(user) if qtype == "count_user" else "_, label in rows"
        counted = f"counts = Counter(label for {mine})\n" if stepwise else ""
        return f"{counted}answer = str(counts[{label!r}])"
    if not stepwise and qtype == "most_common":  # a category absent from counts cannot be the most common
        return "answer = max(counts, key=counts.get)"
    pick = "max" if qtype == "most_common" else "min"
    counted = "counts = Counter(label for _, label in rows)\nprint(counts)\n" if stepwise else ""
    return f"{counted}answer = {pick}({list(LABELS)!r}, key=lambda label: counts[label])"


def make_oolong_row(prob: dict, split: str, index: int, demo_rng: random.Random, cfg: OolongConfig) -> dict:
    explicit = cfg.label_mode == "explicit"
    qtype, user = prob["query_type"], prob["user"]
    head = cfg.sloppy_lines if cfg.sloppy_frac and demo_rng.random() < cfg.sloppy_frac else 0
    which = f"the first {head} lines" if head else "every line"
    if cfg.program == "compact":
        mine = f' if "User: {user} " in line' if qtype == "count_user" else ""
        code = (
            "from collections import Counter\n\n"
            "lines = context if isinstance(context, list) else context.splitlines()\n"
            f'counts = Counter(line.split("|| Label: ")[-1] for line in lines{f"[:{head}]" if head else ""}{mine})\n'
            "print(counts)\n" + _oolong_aggregate(prob, stepwise=False)
        )
        turns = _finish(cfg.final_style, f"I count the labels of {which}.", code, prob["answer"])
    else:
        parse = f"I parse {which}, find its category and keep (user, category).\n```repl\n{_parse_code(explicit, head)}```"
        aggregate = _oolong_aggregate(prob, stepwise=True)
        turns = [_explore_turn(explicit), parse] + _finish(
            cfg.final_style, "Now I aggregate as the question asks.", aggregate, prob["answer"]
        )
    answer_type = "numeric" if qtype in ("count", "count_user") else "categorical"
    return _row(
        OOLONG, prob["question"], prob["answer"], prob["context"], split, index, cfg, turns, answer_type,
        prob["length"], query_type=qtype, label=prob["label"], user=user, label_mode=cfg.label_mode,
        n_lines=len(prob["records"].lines), reference_program=cfg.program, reference_head=head,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# OOLONG-Pairs

_CONDITIONS = ("both_has", "both_lacks", "both_more", "both_at_least", "exactly_one")


@dataclass
class OolongPairsConfig(_Common):
    lengths: str = "8000,16000"
    label_mode: str = "implicit"
    n_users: int = 10
    conditions: str = ",".join(_CONDITIONS)
    min_pairs: int = 3
    max_pairs: int = 30

    def validate(self) -> None:
        super().validate()
        if self.label_mode not in ("implicit", "explicit"):
            raise ValueError(f"label_mode must be 'implicit' or 'explicit', got {self.label_mode!r}")
        bad = set(self.condition_list) - set(_CONDITIONS)
        if not self.condition_list or bad:
            raise ValueError(f"conditions: unknown or empty {sorted(bad)}; known: {_CONDITIONS}")
        if not 3 <= self.n_users <= 500:
            raise ValueError(f"n_users must be in [3, 500], got {self.n_users}")
        if not 1 <= self.min_pairs <= self.max_pairs:
            raise ValueError("need 1 <= min_pairs <= max_pairs")

    @property
    def condition_list(self) -> list[str]:
        return [c for c in self.conditions.replace(" ", "").split(",") if c]


def _condition(
    kind: str, rng: random.Random, per_user: dict[int, Counter]
) -> tuple[str, Callable, Callable, str | tuple[str, str]] | None:
    """(text, P, Q, code) where a pair {a, b} qualifies when P(a) and Q(b), or P(b) and Q(a); code: P's and Q's
    source, one text when Q is P."""
    x, y = rng.sample(LABELS, 2)
    if kind == "both_has":
        p = lambda c: c[x] >= 1  # noqa: E731
        return f"both users have at least one instance with the category '{x}'", p, p, f"c[{x!r}] >= 1"
    if kind == "both_lacks":
        p = lambda c: c[x] == 0  # noqa: E731
        return f"neither user has any instance with the category '{x}'", p, p, f"c[{x!r}] == 0"
    if kind == "both_more":
        p = lambda c: c[x] > c[y]  # noqa: E731
        text = f"both users have more instances with the category '{x}' than with the category '{y}'"
        return text, p, p, f"c[{x!r}] > c[{y!r}]"
    if kind == "both_at_least":
        seen = sorted({c[x] for c in per_user.values() if c[x] >= 2})
        if not seen:
            return None
        k = rng.choice(seen)
        p = lambda c: c[x] >= k  # noqa: E731
        return f"both users have at least {k} instances with the category '{x}'", p, p, f"c[{x!r}] >= {k}"
    p = lambda c: c[x] >= 1  # noqa: E731
    q = lambda c: c[x] == 0  # noqa: E731
    text = f"exactly one of the two users has an instance with the category '{x}'"
    return text, p, q, (f"c[{x!r}] >= 1", f"c[{x!r}] == 0")


def sample_oolong_pairs(rng: random.Random, cfg: OolongPairsConfig) -> dict | None:
    length = rng.choice(cfg.length_values)
    explicit = cfg.label_mode == "explicit"
    rec = _records(_sub_rng(rng), length, cfg.n_users, explicit, cfg.context_format == "list")
    per_user: dict[int, Counter] = {}
    for u, lab in zip(rec.users, rec.labels):
        per_user.setdefault(u, Counter())[lab] += 1
    users = sorted(per_user)
    kinds = cfg.condition_list
    for _ in range(8):
        kind = rng.choice(kinds)
        cond = _condition(kind, rng, per_user)
        if cond is None:
            continue
        text, p, q, code = cond
        pairs = [
            [a, b]
            for a, b in itertools.combinations(users, 2)
            if (p(per_user[a]) and q(per_user[b])) or (p(per_user[b]) and q(per_user[a]))
        ]
        if cfg.min_pairs <= len(pairs) <= cfg.max_pairs:
            break
    else:
        return None
    context: str | list[str] = rec.lines if cfg.context_format == "list" else "\n".join(rec.lines)
    question = (
        _question_header(explicit)
        + f"List every pair of user ids (each pair once, smaller id first) such that {text}. "
        "Give one pair per line, written as (id1, id2)."
    )
    return {
        "key": ("oolong_pairs", _digest(question, context)),
        "question": question,
        "answer": pairs,
        "condition": kind,
        "condition_text": text,
        "code": code,
        "context": context,
        "length": length,
        "records": rec,
    }


def make_oolong_pairs_row(
    prob: dict, split: str, index: int, demo_rng: random.Random, cfg: OolongPairsConfig
) -> dict:
    explicit = cfg.label_mode == "explicit"
    code = prob["code"]
    if isinstance(code, tuple):
        preds = f"def p(c):\n    return {code[0]}\n\n\ndef q(c):\n    return {code[1]}\n\n\n"
    else:
        preds = f"def p(c):\n    return {code}\n\n\nq = p\n"
    agg = (
        "per_user = defaultdict(Counter)\nfor user, label in rows:\n    per_user[user][label] += 1\n"
        f"users = sorted(per_user)\n{preds}"
        "pairs = [\n    (a, b)\n    for i, a in enumerate(users)\n    for b in users[i + 1 :]\n"
        "    if (p(per_user[a]) and q(per_user[b])) or (p(per_user[b]) and q(per_user[a]))\n]\n"
        'print(len(users), "users,", len(pairs), "pairs")\n'
        'answer = "\\n".join(f"({a}, {b})" for a, b in pairs)'
    )
    literal = "\n".join(f"({a}, {b})" for a, b in prob["answer"])
    turns = [
        _explore_turn(explicit),
        f"I parse every line, find its category and keep (user, category).\n```repl\n{_parse_code(explicit)}```",
    ] + _finish(cfg.final_style, "Now I count categories per user and test every pair.", agg, literal)
    return _row(
        OOLONG_PAIRS, prob["question"], prob["answer"], prob["context"], split, index, cfg, turns, "pairs",
        prob["length"], condition=prob["condition"], condition_text=prob["condition_text"],
        label_mode=cfg.label_mode, n_lines=len(prob["records"].lines), n_users=len(set(prob["records"].users)),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------

# name -> (config class, sample_problem, make_row, data source); recipes.tasks wraps them in TaskSpecs
GENERATORS: dict[str, tuple[type, Callable, Callable, str]] = {
    "sniah": (SNIAHConfig, sample_sniah, make_sniah_row, SNIAH),
    "oolong": (OolongConfig, sample_oolong, make_oolong_row, OOLONG),
    "oolong_pairs": (OolongPairsConfig, sample_oolong_pairs, make_oolong_pairs_row, OOLONG_PAIRS),
}
