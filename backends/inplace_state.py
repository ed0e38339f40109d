"""Keep in-place state updates in place: drop `hal.tensor.alias` where the update already is.

IREE's torch input conversion ends every function that mutates an argument with

    %t   = hal.tensor.import %arg               (at entry)
    %new = iree_linalg_ext.scatter ... outs(%t)  (the KV-cache write: in place on %t;
                                                  a decode step's ring write:
                                                  tensor.insert_slice ... into %t[...])
    %a   = hal.tensor.alias %new to %arg         (put the result in the caller's buffer)
    hal.tensor.barrier join(%a, ...)

The scatter already writes into the caller's buffer (its result is tied to the
imported %t), but the alias re-imports %arg as a separate resource, which the pinned
IREE (targets.IREE_VERSION) cannot prove is the same buffer: it copies the whole cache on every call.
For a global layer that copy is max_context slots per step, the largest cost
of a decode step in a long-context bundle (docs/architecture.md, "Attention that
reads the tokens held").

Run between `--compile-to=input` and `--compile-from=input`, this rewrite drops
exactly those aliases whose value is a scatter or slice update into the
import of the same argument, and passes the updated value to the barrier
instead. Every other alias (a prefill chunk's ring write, GDN state: fresh
results IREE places into the argument) stays. The parity tests check that the updated caches are the ones
the next call reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_FUNC = re.compile(r"^\s*(util\.func|func\.func)\b")
_IMPORT = re.compile(r"^\s*(%[\w.]+) = hal\.tensor\.import\b.*=> (%[\w.]+) :")
_SCATTER = re.compile(r"^\s*(%[\w.]+) = iree_linalg_ext\.scatter\b.*\bouts\((%[\w.]+) :")
_INSERT = re.compile(r"^\s*(%[\w.]+) = tensor\.insert_slice %[\w.]+ into (%[\w.]+)\[")
_ALIAS = re.compile(r"^\s*(%[\w.]+) = hal\.tensor\.alias (?:on\([^)]*\) )?wait\(%[\w.]+\) => (%[\w.]+) : .* to (%[\w.]+) :")
_VALUE = re.compile(r"%[\w.]+")


@dataclass
class ElideReport:
    elided: int  # aliases dropped: updates already in the caller's buffer
    kept: int  # aliases left for IREE to place


def _functions(lines: list[str]) -> list[list[str]]:
    """Split module lines into runs that each start at a function (the first run: the preamble)."""
    runs: list[list[str]] = [[]]
    for line in lines:
        if _FUNC.match(line):
            runs.append([])
        runs[-1].append(line)
    return runs


def _elide_in_function(lines: list[str]) -> tuple[list[str], int, int]:
    imported: dict[str, str] = {}  # imported tensor -> the buffer-view argument it came from
    scattered_into: dict[str, str] = {}  # scatter result -> the tensor it updated in place
    uses: dict[str, int] = {}
    for line in lines:
        for value in _VALUE.findall(line.split(" = ", 1)[-1]):
            uses[value] = uses.get(value, 0) + 1
        if m := _IMPORT.match(line):
            imported[m.group(1)] = m.group(2)
        elif (m := _SCATTER.match(line)) or (m := _INSERT.match(line)):
            scattered_into[m.group(1)] = m.group(2)
    out: list[str] = []
    replaced: dict[str, str] = {}  # dropped alias result -> the value it aliased
    elided = kept = 0
    for line in lines:
        if m := _ALIAS.match(line):
            result, value, argument = m.groups()
            target = scattered_into.get(value, "")
            # Only when the scatter is the imported tensor's sole user: IREE then updates it in
            # place (a second reader would make it copy the tensor first, and drop the update).
            if imported.get(target) == argument and uses.get(target) == 1:
                replaced[result] = value
                elided += 1
                continue
            kept += 1
        if replaced:  # uses of a dropped alias (the barrier) read the in-place result
            line = _VALUE.sub(lambda v: replaced.get(v.group(0), v.group(0)), line)
        out.append(line)
    return out, elided, kept


def elide_inplace_aliases(mlir: str) -> tuple[str, ElideReport]:
    """Drop the aliases of in-place scatters into their own argument (see the module docstring)."""
    out: list[str] = []
    elided = kept = 0
    for run in _functions(mlir.split("\n")):
        lines, e, k = _elide_in_function(run)
        out.extend(lines)
        elided, kept = elided + e, kept + k
    return "\n".join(out), ElideReport(elided, kept)
