"""The xdist scheduling rules of conftest.py: one group per shared module fixture, the slowest
tests first, and a SLOWEST_FIRST list that names tests that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import SLOWEST_FIRST, slowest_first

ROOT = Path(__file__).resolve().parents[1]


def test_slowest_first_names_existing_tests_once():
    assert len(set(SLOWEST_FIRST)) == len(SLOWEST_FIRST) > 3
    for prefix in SLOWEST_FIRST:
        path, _, name = prefix.partition("::")
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {re.escape(name)}\w*\(", source, re.M), prefix


def test_items_that_share_a_module_fixture_instance_share_one_group(request):
    """Over the tests of this session: a module-scoped fixture instance never spans groups."""
    group_of_instance: dict[tuple, str] = {}
    for item in request.session.items:
        mark = item.get_closest_marker("xdist_group")
        callspec = getattr(item, "callspec", None)
        for name, defs in item._fixtureinfo.name2fixturedefs.items():
            if defs[-1].scope != "module":
                continue
            assert mark is not None, (item.nodeid, name)
            index = callspec.indices.get(name) if callspec else None
            key = (item.nodeid.split("::")[0], name, index)
            assert group_of_instance.setdefault(key, mark.args[0]) == mark.args[0], key


class FakeItem:
    def __init__(self, nodeid: str, group: str | None = None):
        self.nodeid, self.group = nodeid, group

    def get_closest_marker(self, name):
        assert name == "xdist_group"
        return None if self.group is None else pytest.mark.xdist_group(self.group).mark

    def __repr__(self):
        return self.nodeid


def test_slowest_first_moves_listed_tests_and_their_whole_groups_to_the_front(monkeypatch):
    monkeypatch.setattr("conftest.SLOWEST_FIRST", ("t/b.py::slow", "t/a.py::slower_than_c"))
    items = [
        FakeItem("t/a.py::x"),
        FakeItem("t/a.py::slower_than_c[1]"),
        FakeItem("t/b.py::uses_fixture", "t/b.py::fixture"),
        FakeItem("t/c.py::y"),
        FakeItem("t/b.py::slow", "t/b.py::fixture"),
        FakeItem("t/a.py::slower_than_c[2]"),
    ]
    got = [item.nodeid for item in slowest_first(items)]
    assert got == [
        "t/b.py::uses_fixture",  # the group of the slowest test, in collection order
        "t/b.py::slow",
        "t/a.py::slower_than_c[1]",
        "t/a.py::slower_than_c[2]",
        "t/a.py::x",  # the rest keep their order
        "t/c.py::y",
    ]
