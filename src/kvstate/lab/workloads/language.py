"""A small synthetic language: a fixed word-level vocabulary and a prose generator.

The project trains its small reference models here (no downloads), so the language is built to give
surprisal some structure, as natural text has: prose shifts between topics that each own their nouns,
adjectives and verbs (a topic change is a burst of unseen words), entities are introduced by name and
then mentioned again (the introduction is surprising, the mentions are not), and numbers are written
digit by digit (``4 2 7`` — every digit is its own token, so a number is a sequence).

Every token is a whitespace-separated word, including punctuation (sentences end with the token
``.``), so the WordLevel tokenizer of :mod:`kvstate.lab.workloads.tokenizer` is exact and a text's token
count is its word count. Content words are English; names, cities and variable names are pseudo-words
built by a fixed arithmetic walk over syllables, so the vocabulary is identical on every run and does
not depend on any random number generator. Generation takes an explicit ``numpy.random.Generator``.

Ignored: morphology and agreement (``there were 4 2 ship``); the grammar only has to be regular enough
that a small model can learn it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DIGITS = tuple(str(d) for d in range(10))
PUNCTUATION = (".", ",", "?", ":", "=")


def split_words(text: str) -> tuple[str, ...]:
    """The words of a space-separated string (how the word lists below are written)."""
    return tuple(text.split())


# Grammar and task words, shared by every topic.
FUNCTION_WORDS = split_words(
    "the a of and in on at to with from by for near under over into behind beside across "
    "it they she he there was were is are has had who which that then named "
    "some secret code codes hidden following text remember them what all answer "
    "chains variables value have read coded below count each word words most frequent common list "
    "story about people works as lives keeps years old likes eat where does work live keep how like"
)
ADVERBS = split_words(
    "today again later slowly quietly early soon often once twice still gladly suddenly nearby "
    "together alone outside inside afterwards yesterday"
)
PREPOSITIONS = ("in", "on", "at", "near", "under", "over", "behind", "beside", "across", "into", "from", "by")
PRONOUNS = ("it", "they", "she", "he")

# topic -> (nouns, adjectives, verbs); no word belongs to two topics (tests/test_tokenizer.py checks).
TOPICS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    name: (tuple(n.split()), tuple(a.split()), tuple(v.split()))
    for name, n, a, v in (
        ("sea", "ship boat sail harbor wave tide anchor deck mast sailor island shore reef gull net "
         "lighthouse compass rope cargo dock",
         "salty calm deep stormy misty foamy tidal coastal",
         "sailed drifted anchored rowed floated sank docked steered"),
        ("forest", "tree oak pine fern moss branch leaf root trail owl deer fox acorn stump log clearing "
         "thicket bark mushroom canopy",
         "shady mossy wild dense ancient leafy hollow damp",
         "rustled grew swayed fell sheltered wandered hid climbed"),
        ("kitchen", "pot pan stove oven knife spoon bowl plate cup kettle flour butter salt pepper onion "
         "garlic ladle apron jar table",
         "hot greasy crisp tender bitter sweet spicy fresh",
         "cooked boiled baked stirred chopped fried tasted poured"),
        ("farm", "barn field tractor cow pig hen sheep plow fence hay wheat corn silo orchard pasture "
         "stable goose mule harvest seed",
         "muddy golden ripe rural fertile dusty rustic plowed",
         "planted grazed harvested milked fed sowed watered herded"),
        ("mountain", "peak cliff ridge valley slope glacier summit cave boulder ledge crag gorge rock path "
         "climber pickaxe tent camp altitude avalanche",
         "steep rocky icy lofty rugged jagged sheer remote",
         "scaled descended crumbled echoed towered slipped ascended trekked"),
        ("school", "classroom desk chalk lesson student pupil blackboard pencil notebook exam homework "
         "recess principal ruler eraser backpack grade semester essay lecture",
         "clever diligent curious studious academic bored attentive eager",
         "studied learned memorized graded lectured erased taught copied"),
        ("music", "song drum guitar piano violin flute melody rhythm chord choir concert ballad harp "
         "trumpet tune note singer orchestra cello anthem",
         "loud soft melodic tuneful rhythmic musical catchy gentle",
         "sang played strummed drummed hummed composed rehearsed whistled"),
        ("weather", "cloud rain thunder lightning wind sun moon star sky rainbow fog drizzle hail breeze "
         "storm dawn dusk horizon sunset shower",
         "cloudy sunny rainy foggy bright gloomy clear humid",
         "rained thundered shone glowed darkened cleared drizzled flashed"),
        ("market", "stall merchant coin price basket vendor crowd bargain cart silk spice fabric purse shop "
         "customer counter goods ledger awning scale",
         "busy crowded cheap costly noisy bustling colorful rare",
         "sold bought traded haggled paid counted bargained displayed"),
        ("river", "stream current bridge ferry waterfall rapids delta pond trout reed otter heron canal dam "
         "ford creek marsh willow riverbank raft",
         "murky swift shallow winding flowing glassy rippling narrow",
         "flowed flooded rippled trickled meandered splashed waded crossed"),
        ("desert", "sand dune camel cactus oasis mirage caravan scorpion nomad canyon sandstorm viper palm "
         "saddle skull mesa well gravel sunstroke thirst",
         "arid dry scorching barren sandy endless parched sunbaked",
         "trudged shimmered roamed rode scorched thirsted camped vanished"),
        ("castle", "tower wall gate moat knight king queen throne sword shield banner dungeon armor "
         "drawbridge battlement courtyard crown squire lance citadel",
         "royal noble mighty grand fortified loyal regal proud",
         "ruled guarded defended besieged crowned knelt charged feasted"),
        ("garden", "rose tulip daisy hedge lawn bench fountain shovel rake hoe soil weed bloom petal vine "
         "greenhouse sprout trowel seedling bush",
         "blooming fragrant lush tidy overgrown floral thorny sunlit",
         "bloomed pruned weeded dug trimmed raked sprouted wilted"),
        ("workshop", "hammer nail saw plank drill anvil chisel screw wrench lathe vise glue sawdust toolbox "
         "workbench lumber bolt hinge clamp file",
         "sturdy rough polished wooden metal sharp blunt handmade",
         "hammered sawed drilled sanded welded repaired carved fixed"),
        ("library", "book shelf page scroll atlas chapter volume catalog manuscript ink quill index archive "
         "poem novel bookmark folio tome reader pamphlet",
         "silent bound printed handwritten tattered thick obscure scholarly",
         "borrowed shelved catalogued indexed browsed returned translated whispered"),
        ("hospital", "patient ward bandage medicine pill fever wound surgeon clinic stretcher syringe pulse "
         "ambulance remedy illness recovery splint ointment cough sneeze",
         "sick healthy sterile injured feverish pale weak sore",
         "healed treated bandaged examined recovered coughed sneezed cured"),
        ("railway", "train station platform engine carriage ticket conductor tunnel signal rail timetable "
         "luggage locomotive steam passenger depot junction boxcar whistle track",
         "punctual delayed express rusty overnight steaming local late",
         "departed arrived chugged halted boarded rattled derailed shunted"),
        ("winter", "snow ice sled snowman icicle blizzard scarf mitten fireplace chimney frost skate sleigh "
         "blanket hearth snowflake igloo cabin boot glove",
         "frozen snowy chilly wintry frosty freezing bleak cozy",
         "froze skated shivered melted snowed sledded thawed bundled"),
        ("festival", "parade lantern mask costume firework feast dance juggler acrobat ribbon balloon carnival "
         "garland bonfire procession confetti clown stage banquet jester",
         "festive joyful merry cheerful lively dazzling grandiose jubilant",
         "danced celebrated paraded juggled cheered sparkled decorated marched"),
        ("mine", "shaft ore coal miner copper iron gem crystal helmet dynamite vein quarry rubble lamp "
         "elevator pit nugget seam wagon sieve",
         "underground precious sooty grimy shadowy glittering buried cramped",
         "mined blasted hauled tunneled excavated smelted sifted panned"),
    )
}

# Attribute pools for entities (kvstate.lab.workloads.tasks: qa and the prose's entity introductions).
JOBS = tuple(
    " ".join(p) for p in (
        ("glass", "maker"), ("ship", "builder"), ("night", "guard"), ("river", "pilot"), ("map", "maker"),
        ("bee", "keeper"), ("stone", "mason"), ("horse", "trainer"), ("bridge", "builder"), ("lamp", "lighter"),
        ("clock", "maker"), ("rope", "maker"), ("tax", "collector"), ("wool", "dyer"), ("bell", "ringer"),
        ("door", "keeper"), ("book", "binder"), ("candle", "maker"), ("salt", "trader"), ("fish", "seller"),
    )
)
COLORS = ("red", "grey", "white", "black", "brown", "yellow", "orange", "purple", "spotted", "striped")
ANIMALS = ("cat", "dog", "parrot", "rabbit", "turtle", "hamster", "canary", "lizard", "ferret", "mouse")
FOODS = (
    "plum pie", "fish soup", "rye bread", "goat cheese", "pear jam", "bean stew", "apple cake",
    "rice pudding", "mint tea", "honey buns", "lemon tart", "barley porridge",
)

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = tuple(c + v for c in _CONSONANTS for v in _VOWELS)  # 70 CV syllables
_CITY_SUFFIXES = ("ton", "dale", "mere", "holm", "wick", "ford", "by", "stead")


def _walk(count: int, space: int, stride: int, make, taken: set[str]) -> tuple[str, ...]:
    """First ``count`` new words of ``make(i)`` for ``i`` walking ``0, stride, 2*stride, ...`` mod ``space``.

    ``stride`` is coprime to ``space``, so the walk is a fixed permutation: the same words every run.
    """
    out: list[str] = []
    for k in range(space):
        word = make((k * stride + 11) % space)
        if word not in taken:
            taken.add(word)
            out.append(word)
            if len(out) == count:
                return tuple(out)
    raise AssertionError(f"only {len(out)} of {count} pseudo-words fit a space of {space}")


def _english_words() -> set[str]:
    words = set(FUNCTION_WORDS) | set(ADVERBS) | set(COLORS) | set(ANIMALS)
    for nouns, adjectives, verbs in TOPICS.values():
        words |= set(nouns) | set(adjectives) | set(verbs)
    for phrase in JOBS + FOODS:
        words |= set(phrase.split())
    return words


_TAKEN = _english_words()
_S = len(_SYLLABLES)
# Names: two syllables and an optional final consonant (kalomi, vedun); cities carry a suffix
# (kelaton); variables are three upper-case letters (KAV), never lower-case words.
NAMES = _walk(400, _S * _S * 5, 7919, lambda i: _SYLLABLES[i // (_S * 5)] + _SYLLABLES[i // 5 % _S]
              + ("", "n", "r", "l", "s")[i % 5], _TAKEN)
CITIES = _walk(60, _S * _S * 8, 104729, lambda i: _SYLLABLES[i // (_S * 8)] + _SYLLABLES[i // 8 % _S]
               + _CITY_SUFFIXES[i % 8], _TAKEN)
VARIABLES = _walk(120, 14 * 5 * 14, 409, lambda i: (_CONSONANTS[i // 70] + _VOWELS[i // 14 % 5]
                                                      + _CONSONANTS[i % 14]).upper(), _TAKEN)


@lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Every token of the language, in a fixed order: special tokens first (ids 0-3), then digits."""
    groups: list[tuple[str, ...]] = [SPECIAL_TOKENS, DIGITS, PUNCTUATION, FUNCTION_WORDS, ADVERBS]
    for nouns, adjectives, verbs in TOPICS.values():
        groups += [nouns, adjectives, verbs]
    groups += [tuple(w for p in JOBS + FOODS for w in p.split()), COLORS, ANIMALS, NAMES, CITIES, VARIABLES]
    return tuple(dict.fromkeys(w for g in groups for w in g))


def digits(rng: np.random.Generator, n: int) -> list[str]:
    """A random ``n``-digit number as digit tokens, without a leading zero (``['4', '0', '7']``)."""
    if n < 1:
        raise ValueError(f"digits: n={n} must be >= 1; ask for at least one digit")
    first = int(rng.integers(1, 10))
    return [str(first), *(str(int(d)) for d in rng.integers(0, 10, size=n - 1))]


def number_words(value: int) -> list[str]:
    """A non-negative integer as digit tokens: ``10 -> ['1', '0']``."""
    if value < 0:
        raise ValueError(f"number_words: value={value} is negative; pass a non-negative integer")
    return list(str(value))


@dataclass(frozen=True)
class ProseConfig:
    """Shape of generated prose. Probabilities are per sentence; the rest of the mass is plain sentences."""

    min_sentence: int = 4  # words per sentence (the final '.' included), before the last one is fitted
    max_sentence: int = 16
    min_paragraph: int = 3  # sentences on one topic before the topic may change
    max_paragraph: int = 8
    p_entity_intro: float = 0.06  # "there was a <job> named <name> ."
    p_entity_mention: float = 0.12  # "<name> <verb> the <noun> ." (only once a name was introduced)
    p_number: float = 0.08  # "there were <digits> <noun> ."

    def __post_init__(self) -> None:
        if not 4 <= self.min_sentence <= self.max_sentence:
            raise ValueError(f"ProseConfig: need 4 <= min_sentence ({self.min_sentence}) <= max_sentence "
                             f"({self.max_sentence}); raise max_sentence or lower min_sentence")
        if not 1 <= self.min_paragraph <= self.max_paragraph:
            raise ValueError(f"ProseConfig: need 1 <= min_paragraph ({self.min_paragraph}) <= max_paragraph "
                             f"({self.max_paragraph})")
        total = self.p_entity_intro + self.p_entity_mention + self.p_number
        for name in ("p_entity_intro", "p_entity_mention", "p_number"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"ProseConfig: {name}={getattr(self, name)} must lie in [0, 1]")
        if total > 1.0:
            raise ValueError(f"ProseConfig: sentence-type probabilities sum to {total:.3f} > 1; lower them")


def _pick(rng: np.random.Generator, pool: tuple[str, ...]) -> str:
    return pool[int(rng.integers(len(pool)))]


def _pad(rng: np.random.Generator, words: list[str], k: int, topic: str) -> list[str]:
    """Extend a clause to exactly ``k - 1`` words with prepositional phrases and adverbs, then add '.'."""
    nouns = TOPICS[topic][0]
    while len(words) < k - 1:
        if k - 1 - len(words) >= 3 and rng.random() < 0.85:
            words += [_pick(rng, PREPOSITIONS), "the", _pick(rng, nouns)]
        else:
            words.append(_pick(rng, ADVERBS))
    return [*words, "."]


def _sentence(rng: np.random.Generator, k: int, topic: str, entity: str | None, names: tuple[str, ...],
              cfg: ProseConfig) -> tuple[list[str], str | None]:
    """One sentence of exactly ``k`` words on ``topic``; returns it and the entity now in focus."""
    nouns, adjectives, verbs = TOPICS[topic]
    if k < 4:  # only the very end of a budget lands here
        return [_pick(rng, nouns), _pick(rng, verbs), "."][3 - k:], entity
    u = rng.random()
    if u < cfg.p_entity_intro and names:
        job = _pick(rng, JOBS).split()
        entity = _pick(rng, names)
        core = ["there", "was", "a", *job, "named", entity]
    elif u < cfg.p_entity_intro + cfg.p_entity_mention and entity is not None:
        core = [entity, _pick(rng, verbs), "the", _pick(rng, nouns)]
    elif u < cfg.p_entity_intro + cfg.p_entity_mention + cfg.p_number:
        core = ["there", "were", *number_words(int(rng.integers(2, 100))), _pick(rng, nouns)]
    elif rng.random() < 0.5:
        core = ["the", _pick(rng, adjectives), _pick(rng, nouns), _pick(rng, verbs), "the", _pick(rng, nouns)]
    else:
        core = ["the", _pick(rng, nouns), _pick(rng, verbs)]
    if len(core) > k - 1:
        core = ["the", _pick(rng, nouns), _pick(rng, verbs)]
    return _pad(rng, core, k, topic), entity


def prose(rng: np.random.Generator, n_words: int, avoid: Collection[str] = (),
          config: ProseConfig | None = None) -> list[list[str]]:
    """Sentences of filler prose totalling exactly ``n_words`` words (tokens).

    Paragraphs of ``min_paragraph..max_paragraph`` sentences stay on one topic; each new paragraph moves
    to a different topic. ``avoid`` lists names that must not appear (a task's own entities), so filler
    never mentions a key a task asks about.
    """
    cfg = config or ProseConfig()
    if n_words < 0:
        raise ValueError(f"prose: n_words={n_words} is negative; pass a word budget >= 0")
    names = tuple(n for n in NAMES if n not in set(avoid))
    topics = tuple(TOPICS)
    topic = _pick(rng, topics)
    left_in_paragraph = int(rng.integers(cfg.min_paragraph, cfg.max_paragraph + 1))
    entity: str | None = None
    out: list[list[str]] = []
    remaining = n_words
    while remaining > 0:
        k = int(rng.integers(cfg.min_sentence, cfg.max_sentence + 1))
        if remaining - k < cfg.min_sentence:  # fold a short tail into this sentence
            k = remaining
        if left_in_paragraph == 0:
            topic = topics[(topics.index(topic) + int(rng.integers(1, len(topics)))) % len(topics)]
            left_in_paragraph = int(rng.integers(cfg.min_paragraph, cfg.max_paragraph + 1))
            entity = None
        sentence, entity = _sentence(rng, k, topic, entity, names, cfg)
        out.append(sentence)
        left_in_paragraph -= 1
        remaining -= k
    return out


def join(sentences: list[list[str]]) -> str:
    """The text of a list of sentences (single spaces; the tokenizer's exact inverse)."""
    return " ".join(w for s in sentences for w in s)
