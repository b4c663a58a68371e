"""A synthetic multi-hop world: the CPU demo's corpus and questions.

People, cities, countries and companies with four relations: a person is born in a city
and works for a company, a company is based in a city, a city lies in a country. Each
entity has one short document; questions chain two or three relations, so the second search
depends on what the first one returned::

    "In which country was Velmor Kastri born?"
      search "Velmor Kastri"  -> "Velmor Kastri was born in Draxen and works for ..."
      search "Draxen"         -> "Draxen is a city of Quinaru."
      answer "Quinaru"

What keeps it honest:

- Names are built from a fixed pool of syllables (:data:`SYLLABLES`) by the seed's RNG, so
  every seed shares one vocabulary (one tokenizer fits all) while its entities and facts
  differ: a policy evaluated on another seed's world can only succeed by searching, reading
  and copying.
- Observations hold distractors: first and last names are each shared by a few people, so
  a search for a person also returns namesakes' documents with the same templates (BM25
  ranks the exact name first); a city's name also appears in the documents of the people
  born there and the companies based there. The policy has to read which document and
  which of its facts answer its question (a person's two facts come in random order).
- A question's answer never appears in the first document it needs (checked by the tests).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

# The fixed pool of name pieces: 64 syllables, lower case. A person is two words of 2
# syllables; cities and company names are 2 syllables, countries 3 (from COUNTRY_POOL,
# below): a country's name has its own shape, which seems to tell a tiny policy that it
# holds the answer (with countries shaped like cities, more trajectories keep searching).
SYLLABLES = (
    "ka", "vel", "mor", "dra", "xen", "lun", "tor", "bri", "sal", "quin", "zar", "fen", "gol",
    "ris", "pa", "dun", "mi", "thal", "ver", "os", "ke", "lo", "nar", "bel", "cor", "fi",
    "gan", "hel", "ja", "kir", "lem", "no", "pol", "ru", "sen", "tam", "ul", "va", "wen",
    "yor", "zi", "ash", "bro", "cal", "dor", "el", "fay", "gri", "hu", "ix", "jor", "kel",
    "ma", "nim", "or", "pel", "ra", "sto", "tre", "un", "vo", "wyn", "xa", "yl",
)
COMPANY_SUFFIXES = ("Corp", "Labs", "Works", "Group")
# Document templates; a person's two facts are joined in one sentence, in either order.
BORN = "was born in {0}"
WORKS = "works for {0}"
PERSON = "{0} {1} and {2}."
BASED = "{0} is a company from {1}."
LIES = "{0} is a city of {1}."
COUNTRY = "{0} is a country."
# The phrase of each relation that a document states verbatim before the related entity;
# a gold thought restates it ("born in Draxen") before searching the entity.
# Each phrase ends in its own word (in, for, from, of), so the word before a copied name
# says which relation it answers.
PHRASES = {"born_in": "born in", "works_for": "works for", "based_in": "company from",
           "located_in": "city of"}
# Question templates: (template, hops, relation path from the subject).
QUESTION_TYPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "birth_city": ("In which city was {0} born?", ("born_in",)),
    "birth_country": ("In which country was {0} born?", ("born_in", "located_in")),
    "employer_city": ("In which city is the company {0} works for based?",
                      ("works_for", "based_in")),
    "company_country": ("In which country is {0} based?", ("based_in", "located_in")),
    "employer_country": ("In which country is the company {0} works for based?",
                         ("works_for", "based_in", "located_in")),
}
# Default mix: two-hop questions, some three-hop, no one-hop.
DEFAULT_MIX = {"birth_country": 0.35, "employer_city": 0.3, "company_country": 0.15,
               "employer_country": 0.2}


@dataclass
class Entity:
    """One entity: its name, kind and outgoing relations (relation -> entity name)."""

    name: str
    kind: str  # "person" | "city" | "country" | "company"
    relations: dict[str, str] = field(default_factory=dict)


@dataclass
class World:
    """A generated world.

    ``documents`` are corpus records ``{"id", "title", "text"}``; ``questions`` are QA
    records ``{"id", "question", "answers", "dataset", "hops", "type", "chain"}`` where
    ``chain`` lists the entities from the subject to the answer (one search per entity but
    the last).
    """

    seed: int
    entities: dict[str, Entity]
    documents: list[dict]
    questions: list[dict]

    def document_of(self, name: str) -> dict:
        """The document whose title is ``name``."""
        return self._by_title[name]

    def __post_init__(self) -> None:
        self._by_title = {d["title"]: d for d in self.documents}


def _word(rng: random.Random, n_syllables: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(n_syllables)).capitalize()


def _unique_words(rng: random.Random, count: int, n_syllables: int, used: set[str]) -> list[str]:
    """``count`` fresh capitalised words of ``n_syllables`` pool syllables each.

    Raises ValueError when fresh words run out (a draw keeps failing) instead of looping for
    ever: the pool makes at most ``len(SYLLABLES) ** n_syllables`` words.
    """
    out: list[str] = []
    misses = 0
    while len(out) < count:
        w = _word(rng, n_syllables)
        if w not in used:
            used.add(w)
            out.append(w)
            misses = 0
        elif (misses := misses + 1) > 10_000:
            raise ValueError(f"generate_world: ran out of fresh {n_syllables}-syllable names "
                             f"after {len(used)} (the pool makes at most "
                             f"{len(SYLLABLES) ** n_syllables}); lower n_people (or raise "
                             f"namesakes), n_cities or n_companies")
    return out


# Countries come from one fixed pool shared by every world, like real countries: the
# policy can learn their names once, and what it must read from a world's documents is
# which city lies in which. A fresh three-syllable country per world would have to be
# copied letter by letter from the documents, which a tiny policy often misspells.
COUNTRY_POOL = tuple(_unique_words(random.Random(2026), 48, 3, set()))


def generate_world(seed: int, n_people: int = 300, n_cities: int = 40, n_countries: int = 8,
                   n_companies: int = 40, n_questions: int = 600,
                   namesakes: int = 3, shuffle_facts: bool = True,
                   mix: Mapping[str, float] | None = None, dataset: str = "demo") -> World:
    """Generate a world deterministically from ``seed``.

    Args:
        seed: the RNG seed; another seed gives other entities and facts, same vocabulary.
        n_people: people (each with a birthplace and an employer).
        n_cities: cities (each in one country).
        n_countries: countries, drawn from :data:`COUNTRY_POOL`.
        n_companies: companies (each based in one city).
        n_questions: questions to draw (fewer if the world has fewer distinct ones).
        namesakes: about how many people share each first name; as many last names as
            first names are drawn, each person's at random. 1 gives every person a first
            name of their own (no namesake distractors; last names may still repeat).
        shuffle_facts: randomise the order of the two facts in a person's document, so the
            policy must read rather than copy a fixed position.
        mix: question type -> weight (types in :data:`QUESTION_TYPES`); default
            :data:`DEFAULT_MIX`.
        dataset: the ``dataset`` field of every question.

    Returns:
        The :class:`World`; documents in a fixed order, questions in a seeded random order.
    """
    mix = dict(DEFAULT_MIX if mix is None else mix)
    unknown = sorted(set(mix) - set(QUESTION_TYPES))
    if unknown:
        raise ValueError(f"mix has unknown question types {unknown}; expected some of "
                         f"{sorted(QUESTION_TYPES)}")
    for name, value in (("n_people", n_people), ("n_cities", n_cities),
                        ("n_countries", n_countries), ("n_companies", n_companies),
                        ("namesakes", namesakes)):
        if value < 1:
            raise ValueError(f"generate_world: {name} ({value}) must be >= 1")
    if n_countries > len(COUNTRY_POOL):
        raise ValueError(f"generate_world: n_countries ({n_countries}) is more than the "
                         f"{len(COUNTRY_POOL)} names of COUNTRY_POOL; lower it")
    rng = random.Random(seed)
    used: set[str] = set(COUNTRY_POOL)
    countries = rng.sample(COUNTRY_POOL, n_countries)
    cities = _unique_words(rng, n_cities, 2, used)
    companies = [f"{w} {rng.choice(COMPANY_SUFFIXES)}"
                 for w in _unique_words(rng, n_companies, 2, used)]
    # Name parts shared by about `namesakes` people each, combinations unique.
    n_parts = max(2, -(-n_people // namesakes))
    firsts = _unique_words(rng, n_parts, 2, used)
    lasts = _unique_words(rng, n_parts, 2, used)
    if n_people > n_parts * n_parts:
        raise ValueError(f"generate_world: n_people ({n_people}) is too many for namesakes "
                         f"({namesakes}); lower namesakes")
    people: list[str] = []
    taken: set[str] = set()
    i = 0
    while len(people) < n_people:  # cycle through first names so each is shared evenly
        name = f"{firsts[i % n_parts]} {rng.choice(lasts)}"
        i += 1
        if name not in taken:
            taken.add(name)
            people.append(name)

    entities: dict[str, Entity] = {}
    for c in countries:
        entities[c] = Entity(c, "country")
    for c in cities:
        entities[c] = Entity(c, "city", {"located_in": rng.choice(countries)})
    for c in companies:
        entities[c] = Entity(c, "company", {"based_in": rng.choice(cities)})
    for p in people:
        entities[p] = Entity(p, "person", {"born_in": rng.choice(cities),
                                           "works_for": rng.choice(companies)})

    documents = []
    for k, e in enumerate(entities.values()):
        if e.kind == "person":
            facts = [BORN.format(e.relations["born_in"]), WORKS.format(e.relations["works_for"])]
            if shuffle_facts:
                rng.shuffle(facts)
            text = PERSON.format(e.name, *facts)
        elif e.kind == "city":
            text = LIES.format(e.name, e.relations["located_in"])
        elif e.kind == "company":
            text = BASED.format(e.name, e.relations["based_in"])
        else:
            text = COUNTRY.format(e.name)
        documents.append({"id": f"w{seed}-{k}", "title": e.name, "text": text})

    subjects = {"person": people, "company": companies}
    pools = {t: [(t, s) for s in subjects[_subject_kind(t)]] for t in mix if mix[t] > 0}
    for pool in pools.values():
        rng.shuffle(pool)
    questions: list[dict] = []
    types = sorted(pools)
    weights = [mix[t] for t in types]
    while len(questions) < n_questions and any(pools.values()):
        t = rng.choices(types, weights)[0]
        if not pools[t]:
            weights[types.index(t)] = 0.0
            if not any(weights):
                break
            continue
        _, subject = pools[t].pop()
        template, path = QUESTION_TYPES[t]
        chain = [subject]
        for rel in path:
            chain.append(entities[chain[-1]].relations[rel])
        if any(chain[-1] in entities[e].relations.values() for e in chain[:-2]):
            continue  # a shortcut: an earlier document already names the answer
        questions.append({"id": f"{dataset}-{seed}-{len(questions)}",
                          "question": template.format(subject), "answers": [chain[-1]],
                          "dataset": dataset, "hops": len(path), "type": t, "chain": chain})
    return World(seed=seed, entities=entities, documents=documents, questions=questions)


def _subject_kind(question_type: str) -> str:
    return "company" if question_type == "company_country" else "person"


def gold_turns(question: dict, world: World) -> list[str]:
    """The gold agent turns of a question: search each entity of the chain; after each
    observation, restate the phrase that leads on (copied from the document), then search
    the next entity or answer.

    ``In which country was A born?`` with chain ``[A, C, K]`` gives::

        <think> find A</think><search> A</search>
        <think> born in C</think><search> C</search>
        <think> city of K</think><answer> K</answer>

    The space after each opening tag makes a name's tokens the same as in running text.
    """
    chain = question["chain"]
    turns = [f"<think> find {chain[0]}</think><search> {chain[0]}</search>"]
    for k in range(1, len(chain)):
        tag = "answer" if k == len(chain) - 1 else "search"
        turns.append(f"<think> {fact_phrase(world, chain[k - 1], chain[k])}</think>"
                     f"<{tag}> {chain[k]}</{tag}>")
    return turns


def relation(world: World, subject: str, obj: str) -> str:
    """The relation from ``subject`` to ``obj`` (e.g. "born_in")."""
    for rel, target in world.entities[subject].relations.items():
        if target == obj:
            return rel
    raise KeyError(f"{subject!r} has no relation to {obj!r}")


def fact_phrase(world: World, subject: str, obj: str) -> str:
    """``"<phrase> <obj>"`` as ``subject``'s document states it (e.g. "born in Draxen")."""
    phrase = f"{PHRASES[relation(world, subject, obj)]} {obj}"
    text = world.document_of(subject)["text"]
    assert phrase in text, f"{subject!r}'s document does not state {phrase!r}: {text!r}"
    return phrase


def vocabulary_text(seed: int = 0, n_worlds: int = 4, **sizes) -> list[str]:
    """Text for training the demo tokenizer: every syllable in each casing, and the
    documents and questions of ``n_worlds`` worlds (seeds far from the demo's), so the BPE
    learns syllables and templates but few whole names."""
    texts = [" ".join(SYLLABLES), " ".join(s.capitalize() for s in SYLLABLES)] * 20
    for k in range(n_worlds):
        w = generate_world(10_000 + seed + k, **sizes)
        for d in w.documents:
            texts.append(f"Doc 1(Title: {d['title']}) {d['text']}")
        for q in w.questions:
            texts.append(q["question"] + " " + " ".join(gold_turns(q, w)))
    return texts
