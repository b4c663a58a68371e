"""A small shop database made by hand (``ROWS``): the SQL sandbox's and the SQL task's tests
derive their expected results from these rows."""

from __future__ import annotations

import sqlite3


ROWS = {
    "customers": [(1, "Ana Silva", "Oslo", 30), (2, "Ben Berg", "Lyon", 40),
                  (3, "Chloe Costa", "Oslo", 50)],
    "products": [(1, "Blue Lamp", "toys", 10), (2, "Red Drum", "music", 25),
                 (3, "Small Ball", "toys", 5)],
    "orders": [(1, 1, 1, 2), (2, 1, 2, 1), (3, 2, 3, 4), (4, 3, 1, 3)],
}


def write_shop(path) -> None:
    """A hand-made shop database (the rows above), the values the tests derive by hand."""
    con = sqlite3.connect(path)
    con.executescript("""
        CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT, age INTEGER);
        CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, category TEXT,
                               price INTEGER);
        CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER,
                             product_id INTEGER, quantity INTEGER);""")
    for table, rows in ROWS.items():
        con.executemany(f"INSERT INTO {table} VALUES (?, ?, ?, ?)", rows)
    con.commit()
    con.close()
