"""Eviction over the prefix store's radix tree (pure; no torch): which leaves and single recurrent states to
free so a request fits the byte budget, and the removal itself.

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") keeps placement and
eviction apart; here eviction frees only unpinned leaves (so every state's KV prefix exists) or single
states, in the order of :func:`kvstate.prefix.eviction.eviction_order` (LRU or utility). Victims are chosen
without mutation first, so a request that cannot fit leaves the store as it was.
"""

from __future__ import annotations

from kvstate.prefix.eviction import Unit, eviction_order
from kvstate.prefix.store_types import Node, StoreConfig


class TreeEviction:
    """Mixed into :class:`kvstate.prefix.store.PrefixStore`, which provides the tree and the counters."""

    config: StoreConfig
    root: Node
    _m: dict[str, int]

    def nodes(self) -> list[Node]:
        raise NotImplementedError

    @property
    def used_bytes(self) -> int:
        raise NotImplementedError

    def _notify(self, event: str, kind: str, v: Node, end: int, start: int = 0) -> None:
        raise NotImplementedError

    def _is_leaf(self, v: Node, gone: set[int]) -> bool:
        return all(id(u) in gone for u in v.children.values())

    def _units(self, protect: set[int]) -> list[tuple[Unit, Node]]:
        out = []
        nodes = self.nodes()
        held: set[int] = set()  # pinned nodes and their ancestors keep their states too
        for v in nodes:
            u: Node | None = v if v.pins else None
            while u is not None and id(u) not in held:
                held.add(id(u))
                u = u.parent
        for v in nodes:
            for p, s in v.states.items():
                if id(v) in held:
                    continue
                saved = float(p - v.top) * max(v.sub_mass, 0.0)
                out.append((Unit(v.id, p, s.nbytes, s.last_access, saved), v))
            if id(v) not in protect and v.pins == 0 and not v.children:
                out.append(
                    (Unit(v.id, None, self._node_bytes(v), v.last_access, len(v.edge) * v.sub_mass), v)
                )
        return out

    def _node_bytes(self, v: Node) -> int:
        c = self.config
        kv = len(v.edge) * c.kv_bytes_per_token if c.has_attention else 0
        return kv + sum(s.nbytes for s in v.states.values()) + sum(v.logits_nbytes.values())

    def _choose_victims(self, need: int, protect: set[int]) -> list[tuple[Unit, Node]] | None:
        """Units to evict so that ``need`` more bytes fit (no mutation), or None when they cannot."""
        over = self.used_bytes + need - self.config.budget_bytes
        if over <= 0:
            return []
        units = self._units(protect)
        order = eviction_order(
            [u for u, _ in units], self.config.policy, self.config.flops_per_token, self.config.alpha
        )
        by_unit = {id(u): v for u, v in units}
        gone: set[int] = set()  # nodes evicted whole
        dropped: dict[int, int] = {}  # node id → bytes of its states chosen one by one
        chosen: list[tuple[Unit, Node]] = []
        freed = 0
        queue = list(order)
        i = 0
        while freed < over and i < len(queue):
            u = queue[i]
            i += 1
            v = by_unit[id(u)]
            if id(v) in gone:
                continue
            if u.position is None:
                nbytes = self._node_bytes(v) - dropped.get(v.id, 0)
                gone.add(id(v))
                chosen.append((u, v))
                freed += nbytes
                par = v.parent  # a parent left childless becomes an evictable leaf
                free = par is not None and par is not self.root and id(par) not in protect and par.pins == 0
                if par is not None and free and self._is_leaf(par, gone):
                    pu = Unit(par.id, None, self._node_bytes(par), par.last_access, 0.0)
                    by_unit[id(pu)] = par
                    queue.insert(i, pu)
            else:
                dropped[v.id] = dropped.get(v.id, 0) + u.nbytes
                chosen.append((u, v))
                freed += u.nbytes
        return chosen if freed >= over else None

    def _evict(self, victims: list[tuple[Unit, Node]]) -> None:
        for u, v in victims:
            if u.position is None:
                self._remove_leaf(v)
            elif u.position in v.states and (v.parent is not None):
                s = v.states.pop(u.position)
                self._m["bytes_end_states" if s.end else "bytes_checkpoints"] -= s.nbytes
                self._m["evicted_states"] += 1
                self._notify("evicted", "state", v, u.position)
        self._prune_empty()

    def _remove_leaf(self, v: Node) -> None:
        if v.parent is None or v.parent.children.get(v.edge[0]) is not v:
            return  # already removed with a subtree
        c = self.config
        for u in [v, *self._below(v)]:
            self._m["bytes_kv"] -= len(u.edge) * c.kv_bytes_per_token if c.has_attention else 0
            if c.has_attention:
                self._notify("evicted", "kv", u, u.depth, u.top)
            for p, s in u.states.items():
                self._m["bytes_end_states" if s.end else "bytes_checkpoints"] -= s.nbytes
                self._notify("evicted", "state", u, p)
            self._m["bytes_logits"] -= sum(u.logits_nbytes.values())
        del v.parent.children[v.edge[0]]
        anc: Node | None = v.parent
        while anc is not None:
            anc.sub_mass -= v.sub_mass
            anc = anc.parent
        self._m["evicted_nodes"] += 1

    def _below(self, v: Node) -> list[Node]:
        out, stack = [], list(v.children.values())
        while stack:
            u = stack.pop()
            out.append(u)
            stack.extend(u.children.values())
        return out

    def _prune_empty(self) -> None:
        """Without attention KV a node is only worth its states: drop unpinned leaves that hold nothing."""
        if self.config.has_attention:
            return
        changed = True
        while changed:
            changed = False
            for v in self.nodes():
                if not v.children and not v.states and not v.logits and v.pins == 0:
                    self._remove_leaf(v)
                    self._m["evicted_nodes"] -= 1  # bookkeeping, not an eviction
                    changed = True
