"""The xdist scheduling rule of conftest.py: the slowest modules first, named by a
SLOWEST_FIRST list whose entries name tests that exist."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import SLOWEST_FIRST, slowest_first

ROOT = Path(__file__).resolve().parents[1]


def test_slowest_first_names_existing_tests_once():
    assert len(set(SLOWEST_FIRST)) == len(SLOWEST_FIRST) > 3
    for prefix in SLOWEST_FIRST:
        path, _, name = prefix.partition("::")
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {re.escape(name)}\w*\(", source, re.M), prefix


class FakeItem:
    def __init__(self, nodeid: str):
        self.nodeid = nodeid

    def __repr__(self):
        return self.nodeid


def test_slowest_first_moves_whole_modules_to_the_front_in_the_lists_order(monkeypatch):
    monkeypatch.setattr("conftest.SLOWEST_FIRST", ("t/b.py::slow", "t/a.py::slower_than_c"))
    ids = [
        "t/a.py::x",
        "t/a.py::slower_than_c[1]",
        "t/b.py::uses_a_module_fixture",
        "t/c.py::y",
        "t/b.py::slow",
        "t/a.py::slower_than_c[2]",
    ]
    got = [item.nodeid for item in slowest_first([FakeItem(i) for i in ids])]
    assert got == [
        "t/b.py::uses_a_module_fixture",  # the slowest test's module, in collection order
        "t/b.py::slow",
        "t/a.py::x",
        "t/a.py::slower_than_c[1]",
        "t/a.py::slower_than_c[2]",
        "t/c.py::y",  # the rest keep their order
    ]
