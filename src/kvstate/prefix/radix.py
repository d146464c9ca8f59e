"""A compressed radix tree over token ids that indexes cached prefix entries (pure; no torch).

Seed 000 places checkpoints *inside* one retained entry; this index finds, for a new request, every
cached entry that shares a prefix with it and how deep (the overlap depth ``t`` of the placement problem, ``docs/techniques.md#position``). Edges are
labelled with token tuples and split on insert (SGLang-style); entries are attached to the node where
their token path ends. Lookups never touch tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NewType

EntryId = NewType("EntryId", int)


@dataclass(eq=False)
class _Node:
    edge: tuple[int, ...]  # tokens on the edge from the parent to this node
    depth: int  # tokens from the root to the end of this node's edge
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)  # first token of child edge → child
    entries: set[EntryId] = field(default_factory=set)  # entries whose tokens end exactly here


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixIndex:
    """Token-id radix tree: ``insert``/``remove`` entries, ``overlaps`` for a request."""

    def __init__(self) -> None:
        self._root = _Node(edge=(), depth=0, parent=None)
        self._leaf: dict[EntryId, _Node] = {}

    def __len__(self) -> int:
        return len(self._leaf)

    def __contains__(self, entry: EntryId) -> bool:
        return entry in self._leaf

    def insert(self, entry: EntryId, tokens: Sequence[int]) -> None:
        if entry in self._leaf:
            raise ValueError(f"entry {entry} is already indexed; remove it first.")
        if len(tokens) == 0:
            raise ValueError("cannot index an empty token sequence.")
        node, pos = self._root, 0
        toks = tuple(int(t) for t in tokens)
        while pos < len(toks):
            child = node.children.get(toks[pos])
            if child is None:
                leaf = _Node(edge=toks[pos:], depth=len(toks), parent=node)
                node.children[toks[pos]] = leaf
                node = leaf
                pos = len(toks)
                break
            k = _lcp(child.edge, toks[pos:])
            if k < len(child.edge):  # split the edge at k
                mid = _Node(edge=child.edge[:k], depth=child.depth - len(child.edge) + k, parent=node)
                node.children[toks[pos]] = mid
                child.edge = child.edge[k:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            node, pos = child, pos + k
        node.entries.add(entry)
        self._leaf[entry] = node

    def remove(self, entry: EntryId) -> None:
        node = self._leaf.pop(entry)
        node.entries.discard(entry)
        # prune empty leaves and merge single-child pass-through nodes
        while node is not self._root and not node.entries and not node.children:
            parent = node.parent
            assert parent is not None
            del parent.children[node.edge[0]]
            node = parent
        if node is not self._root and not node.entries and len(node.children) == 1:
            (child,) = node.children.values()
            parent = node.parent
            assert parent is not None
            child.edge = node.edge + child.edge
            child.parent = parent
            parent.children[node.edge[0]] = child

    def overlaps(self, tokens: Sequence[int]) -> dict[EntryId, int]:
        """Every indexed entry sharing at least one leading token with ``tokens`` → its overlap depth."""
        out: dict[EntryId, int] = {}
        node, pos = self._root, 0
        toks = tuple(int(t) for t in tokens)
        while True:
            nxt = node.children.get(toks[pos]) if pos < len(toks) else None
            # entries ending at this node, and those below other children, share exactly `pos` tokens
            for e in node.entries:
                out[e] = pos
            for _first, child in node.children.items():
                if child is not nxt and pos > 0:
                    for e in self._entries_below(child):
                        out[e] = pos
            if nxt is None:
                return out
            k = _lcp(nxt.edge, toks[pos:])
            if k < len(nxt.edge):  # the request leaves the tree inside this edge
                for e in self._entries_below(nxt):
                    out[e] = pos + k if pos + k > 0 else 0
                return {e: d for e, d in out.items() if d > 0}
            node, pos = nxt, pos + k

    def _entries_below(self, node: _Node) -> Iterator[EntryId]:
        stack = [node]
        while stack:
            n = stack.pop()
            yield from n.entries
            stack.extend(n.children.values())
