"""The instructions of an optimized XLA HLO module (``compiled.as_text()``) that run as their
own thunks: those outside fusion bodies, whose elementwise ops compute only what their fusion's
output reads. For checks that a program holds no copy of some large array."""

from __future__ import annotations

import re
from typing import NamedTuple

INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(")
COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) ")
CALLS = re.compile(r"calls=%([\w.-]+)")
BODIES = re.compile(r"body=%([\w.-]+)")
# Instructions that name or pass on a buffer without writing one.
NOT_A_COPY = {"parameter", "get-tuple-element", "bitcast", "tuple"}


class Instruction(NamedTuple):
    computation: str
    name: str
    opcode: str
    dims: tuple[int, ...]
    line: str


def unfused(hlo: str) -> list[Instruction]:
    """Every instruction outside fusion bodies with its computation, name, opcode and output
    dims (instructions with a tuple-shaped output are not listed)."""
    fused = set(CALLS.findall(hlo))
    found, computation = [], None
    for line in hlo.splitlines():
        header = COMPUTATION.match(line)
        if header:
            computation = header.group(1)
            continue
        m = INSTRUCTION.match(line)
        if m and computation not in fused:
            dims = tuple(int(d) for d in m.group(3).split(",") if d)
            found.append(Instruction(computation, m.group(1), m.group(4), dims, line.strip()[:200]))
    return found


def loop_bodies(hlo: str) -> set[str]:
    """The names of the computations that are the body of a while loop."""
    return set(BODIES.findall(hlo))
