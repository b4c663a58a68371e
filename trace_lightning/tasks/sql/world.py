"""Generated relational databases: three schema families, each three tables with keys.

Every family has the same shape, named its own way: a table of people (``id``, a unique
``name``, a category, a number), a table of items (``id``, ``name``, a category, a number
unique within the database) and a table of links between them (``id``, the two foreign
keys, a number)::

    shop:    customers(id, name, city, age)        products(id, name, category, price)
             orders(id, customer_id, product_id, quantity)
    school:  students(id, name, house, age)        courses(id, name, subject, seats)
             enrollments(id, student_id, course_id, score)
    company: employees(id, name, office, age)      projects(id, name, area, budget)
             assignments(id, employee_id, project_id, hours)

A database's rows are drawn from ``random.Random(seed)``: names from fixed pools of word
pieces (every seed draws from the same pools, so one tokenizer fits every database) and
numbers from fixed ranges. ``build_database`` writes one SQLite file; it is the only writer,
and the task opens the file read-only.
"""

from __future__ import annotations

import random
import sqlite3
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Family:
    """One schema family: its tables' and columns' names, the value pools and ranges."""

    name: str
    people: str  # table of people, e.g. customers
    person: str  # one of them, e.g. customer (the link table's key is <person>_id)
    pcat: str  # the people's category column, e.g. city
    pcats: tuple[str, ...]
    pnum: str  # the people's number column, e.g. age
    pnum_range: tuple[int, int]
    items: str  # table of items, e.g. products
    item: str
    icat: str
    icats: tuple[str, ...]
    inum: str  # unique within a database (ordering questions have one answer)
    inum_range: tuple[int, int]
    item_words: tuple[tuple[str, ...], tuple[str, ...]]  # an item's name: first + second
    links: str  # table of links, e.g. orders
    lnum: str
    lnum_range: tuple[int, int]

    @property
    def pkey(self) -> str:
        return f"{self.person}_id"

    @property
    def ikey(self) -> str:
        return f"{self.item}_id"

    @property
    def schema(self) -> str:
        """The tables as a prompt shows them."""
        return (f"{self.people}(id, name, {self.pcat}, {self.pnum}), "
                f"{self.items}(id, name, {self.icat}, {self.inum}), "
                f"{self.links}(id, {self.pkey}, {self.ikey}, {self.lnum})")


FIRST_NAMES = ("Ana", "Ben", "Chloe", "Dev", "Eva", "Farid", "Grace", "Hugo", "Iris", "Jonas",
               "Kira", "Leo", "Maya", "Nico", "Olga", "Pablo", "Rosa", "Sami", "Tara", "Umar")
LAST_NAMES = ("Silva", "Berg", "Costa", "Dahl", "Esposito", "Fischer", "Garcia", "Horvat",
              "Ito", "Jensen", "Kowalski", "Lopez", "Moreau", "Novak", "Okafor", "Petrov",
              "Quinn", "Rossi", "Sato", "Weber")

FAMILIES = {
    "shop": Family(
        "shop", "customers", "customer", "city",
        ("Oslo", "Lyon", "Porto", "Graz", "Turin", "Bergen", "Ghent", "Basel"),
        "age", (18, 70), "products", "product", "category",
        ("toys", "books", "tools", "garden", "music", "sports"), "price", (5, 250),
        (("Blue", "Red", "Small", "Large", "Smart", "Classic", "Golden", "Silver"),
         ("Lamp", "Kettle", "Chair", "Drum", "Ball", "Atlas", "Hammer", "Rake")),
        "orders", "quantity", (1, 9)),
    "school": Family(
        "school", "students", "student", "house",
        ("Falcon", "Otter", "Badger", "Heron", "Lynx", "Raven"),
        "age", (11, 18), "courses", "course", "subject",
        ("math", "art", "history", "science", "music", "language"), "seats", (10, 240),
        (("Intro", "Applied", "Modern", "Early", "Advanced", "Practical", "World", "Open"),
         ("Algebra", "Painting", "Poetry", "Physics", "Chemistry", "Drama", "Maps", "Choir")),
        "enrollments", "score", (40, 99)),
    "company": Family(
        "company", "employees", "employee", "office",
        ("North", "South", "Harbor", "Central", "Airport", "Garden", "River"),
        "age", (22, 65), "projects", "project", "area",
        ("web", "data", "security", "cloud", "mobile", "design"), "budget", (20, 900),
        (("Apollo", "Borealis", "Cobalt", "Delta", "Ember", "Falcon", "Granite", "Harbor"),
         ("Portal", "Engine", "Shield", "Bridge", "Vault", "Pulse", "Atlas", "Beacon")),
        "assignments", "hours", (1, 60)),
}


@dataclass(frozen=True)
class Size:
    """Rows of each table of a database."""

    people: int = 24
    items: int = 16
    links: int = 60


def database_rows(family: Family, seed: int, size: Size = Size()) -> dict[str, list[tuple]]:
    """Each table's rows (ids from 1) for ``family`` drawn from ``seed``."""
    rng = random.Random(seed)
    names = rng.sample([f"{f} {last}" for f in FIRST_NAMES for last in LAST_NAMES],
                       size.people)
    lo, hi = family.pnum_range
    people = [(k + 1, name, rng.choice(family.pcats), rng.randint(lo, hi))
              for k, name in enumerate(names)]
    first, second = family.item_words
    item_names = rng.sample([f"{a} {b}" for a in first for b in second], size.items)
    lo, hi = family.inum_range
    numbers = rng.sample(range(lo, hi + 1), size.items)  # unique: a strict order
    items = [(k + 1, name, rng.choice(family.icats), n)
             for k, (name, n) in enumerate(zip(item_names, numbers))]
    lo, hi = family.lnum_range
    links = [(k + 1, rng.randint(1, size.people), rng.randint(1, size.items),
              rng.randint(lo, hi)) for k in range(size.links)]
    return {family.people: people, family.items: items, family.links: links}


def build_database(path: str | Path, family: Family, seed: int, size: Size = Size()) -> Path:
    """Write ``family``'s database drawn from ``seed`` to ``path`` (replaced if there)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.unlink(missing_ok=True)
    f = family
    con = sqlite3.connect(tmp)
    try:
        con.executescript(f"""
            CREATE TABLE {f.people} (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE,
                                     {f.pcat} TEXT NOT NULL, {f.pnum} INTEGER NOT NULL);
            CREATE TABLE {f.items} (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE,
                                    {f.icat} TEXT NOT NULL, {f.inum} INTEGER NOT NULL UNIQUE);
            CREATE TABLE {f.links} (id INTEGER PRIMARY KEY,
                                    {f.pkey} INTEGER NOT NULL REFERENCES {f.people}(id),
                                    {f.ikey} INTEGER NOT NULL REFERENCES {f.items}(id),
                                    {f.lnum} INTEGER NOT NULL);""")
        for table, rows in database_rows(f, seed, size).items():
            con.executemany(f"INSERT INTO {table} VALUES (?, ?, ?, ?)", rows)
        con.commit()
    finally:
        con.close()
    tmp.replace(path)
    return path
