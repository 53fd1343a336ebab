"""Radix-tree prefix cache over token ids, with per-session namespaces for holes.

The counterpart of SGLang's ``RadixCache``: nodes hold a run of token ids (``key``) and the
slots of those tokens (``value``); matches split nodes at the match end; in-flight requests
lock their matched path (``lock_ref`` on the node and its ancestors) so LRU eviction skips it;
``evict(n)`` deletes least-recently-used unlocked leaves.

What differs, and why:

- **Cells per (layer, KV head).** A node's value is ``[L * Hkv, n]``: the cell of each
  position in each column (:mod:`agentkv.cache.slot_map`), so evictions and precision moves
  made per (layer, head) are stored as they are.
- **Namespaces.** The *shared* namespace holds only intact content (every cell live, at full
  precision): any session whose prompt starts with those tokens may reuse it. Each session
  has its own namespace whose nodes also carry DEAD and quantized cells: the session's earlier
  eviction and quantization decisions, matched as they are on its next turn (no
  re-quantization, no full-precision re-prefill). This is SGLang's
  ``RadixKey.extra_key`` isolation with ``extra_key = session_id`` (here one root per
  namespace, so ending a session drops one subtree).
- **Tenant namespaces (cache salt).** ``match`` / ``insert`` / ``end_session`` take an optional
  ``namespace`` (a tenant's cache salt, vLLM ``cache_salt``): it scopes both the shared and the
  session lookups, so nothing cached under one namespace is ever matched under another.
  ``namespace=None`` is the default tenant (the plain shared and session roots).
- **Counted references.** Each node holds one allocator reference on each non-DEAD slot of its
  value; deleting a node drops them. Requests hold their own references (in their slot maps),
  so a node and a request never "own" a slot on each other's behalf.
- **Latest wins in a session.** Inserting into a session namespace over tokens already there
  replaces the stored slots / mask with the new ones (the newer request saw and extended the
  older holes). The shared namespace keeps the first stored copy, as SGLang does.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from agentkv.cache.dead_slot import DEAD
from agentkv.cache.slot_allocator import SlotAllocator


@dataclass(eq=False)
class TreeNode:
    """One radix-tree node.

    Attributes:
        key: int64 ``[n]`` token ids (empty for a root).
        value: int64 ``[L * Hkv, n]`` cells of those tokens; DEAD and quantized cells only in
            session namespaces.
        parent: parent node (``None`` for a root).
        session_id: namespace: the session id, or ``None`` for the shared namespace.
        children: first token id -> child.
        lock_ref: in-flight requests whose matched path passes through this node.
        last_access: logical clock of the last match / insert touching this node.
    """

    key: torch.Tensor
    value: torch.Tensor = field(repr=False)
    parent: TreeNode | None = field(repr=False)
    session_id: str | None
    children: dict[int, TreeNode] = field(default_factory=dict, repr=False)
    lock_ref: int = 0
    last_access: int = 0

    def __len__(self) -> int:
        return int(self.key.numel())

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclass(frozen=True)
class MatchResult:
    """Longest cached prefix of a token sequence.

    Attributes:
        length: matched tokens ``m`` (holes included).
        slots: int64 ``[L * Hkv, m]`` cells of the matched positions; DEAD at the session's
            holes.
        last_node: node where the match ends (lock it while the request runs).
        from_session: whether the match came from the session's namespace (else shared).
    """

    length: int
    slots: torch.Tensor
    last_node: TreeNode
    from_session: bool


def _ns_key(namespace: str | None, session_id: str | None) -> str | tuple[str, str | None] | None:
    """``_sessions`` key of a session (or, with ``session_id=None``, of a tenant's shared root)."""
    if namespace is None:
        return session_id
    return (namespace, session_id)


def _common_prefix_len(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(int(a.numel()), int(b.numel()))
    if n == 0:
        return 0
    neq = torch.nonzero(a[:n] != b[:n])
    return n if neq.numel() == 0 else int(neq[0, 0])


class PrefixCache:
    """Prefix cache with a shared namespace and one namespace per session.

    Args:
        allocator: the cell allocator whose references the nodes hold.
    """

    def __init__(self, allocator: SlotAllocator) -> None:
        self.allocator = allocator
        self.num_columns = allocator.num_columns
        self.full_limit = allocator.layout.int4_base
        self._clock = itertools.count(1)
        self._shared = self._new_root(None)
        # session roots by id; with a tenant namespace ``ns``: ``(ns, id)`` for a session,
        # ``(ns, None)`` for that tenant's shared root (see :func:`_ns_key`)
        self._sessions: dict[str | tuple[str, str | None], TreeNode] = {}

    # ------------------------------------------------------------- queries
    def match(
        self,
        session_id: str | None,
        token_ids: torch.Tensor,
        max_len: int | None = None,
        namespace: str | None = None,
    ) -> MatchResult:
        """Longest prefix of ``token_ids`` (int64 ``[T]``, capped at ``max_len``) cached in the
        session's namespace or the shared one; on a tie the session's wins, and so it does
        whenever its match holds one of the session's holes or quantized cells: a longer
        shared match would heal evictions (or undo quantization) the session already decided (e.g. when
        another session cached the same conversation unevicted). Splits the node where the
        match ends and refreshes access times along the matched path. ``namespace`` (a tenant's
        cache salt) scopes both lookups."""
        tokens = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        if max_len is not None:
            tokens = tokens[: max(0, max_len)]
        shared = self._shared_root(namespace)
        best_root, best_len, from_session = shared, self._peek(shared, tokens), False
        key = _ns_key(namespace, session_id) if session_id is not None else None
        root = self._sessions.get(key) if key is not None else None
        if root is not None:
            n = self._peek(root, tokens)
            if n > 0 and (n >= best_len or self._has_hole(self._walk(root, tokens[:n]))):
                best_root, best_len, from_session = root, n, True
        path = self._walk(best_root, tokens[:best_len])
        last = path[-1] if path else best_root
        if path:
            slots = torch.cat([n.value for n in path], dim=1)
        else:
            slots = torch.empty(self.num_columns, 0, dtype=torch.int64)
        return MatchResult(best_len, slots, last, from_session)

    def _has_hole(self, path: list[TreeNode]) -> bool:
        return any(not self._intact(n.value) for n in path)

    def _intact(self, value: torch.Tensor) -> bool:
        """Every cell live and at full precision."""
        return bool(((value != DEAD) & (value < self.full_limit)).all())

    def sessions(self) -> list[str | tuple[str, str | None]]:
        """Session ids that have a namespace now (``(namespace, id)`` in a tenant namespace)."""
        return [k for k, r in self._sessions.items() if r.session_id is not None]

    def roots(self) -> list[TreeNode]:
        """Current namespace roots: the shared one first, then one per session."""
        return [self._shared, *self._sessions.values()]

    def iter_nodes(self) -> Iterator[tuple[str | None, int, TreeNode]]:
        """Every non-root node as ``(session_id or None, start position, node)``."""
        roots = [(None, self._shared)] + [(r.session_id, r) for r in self._sessions.values()]
        for sid, root in roots:
            stack = [(0, c) for c in root.children.values()]
            while stack:
                start, node = stack.pop()
                yield sid, start, node
                stack.extend((start + len(node), c) for c in node.children.values())

    @property
    def num_nodes(self) -> int:
        """Non-root nodes over all namespaces."""
        return sum(1 for _ in self.iter_nodes())

    def held_cells(self) -> int:
        """Live cells held by nodes over all namespaces (a cell in two nodes counts twice)."""
        return sum(int((n.value != DEAD).sum()) for _, _, n in self.iter_nodes())

    @property
    def cached_tokens(self) -> int:
        """Token positions stored over all namespaces (holes included, shared slots counted
        once per node holding them)."""
        return sum(len(n) for _, _, n in self.iter_nodes())

    # ----------------------------------------------------------- mutation
    def insert(
        self,
        token_ids: torch.Tensor,
        slots: torch.Tensor,
        session_id: str | None = None,
        namespace: str | None = None,
    ) -> TreeNode:
        """Store ``token_ids`` (int64 ``[T]``) -> cells ``slots`` (int64 ``[L * Hkv, T]``).

        ``session_id=None`` inserts into the shared namespace, which accepts only intact
        content (every cell live at full precision). Takes one reference per non-DEAD cell
        newly held by a node. Returns the node where the inserted sequence ends (a root when
        ``T == 0``, creating no namespace). ``namespace``: the tenant namespace (cache salt).
        """
        tokens = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        vals = torch.as_tensor(slots, dtype=torch.int64)
        n = int(tokens.numel())
        if tuple(vals.shape) != (self.num_columns, n):
            raise ValueError(
                f"slots must be [{self.num_columns}, {n}] for {n} tokens, got {list(vals.shape)}"
            )
        shared = session_id is None
        key = _ns_key(namespace, session_id)
        if n == 0:
            return self._sessions.get(key, self._shared) if key is not None else self._shared
        if shared:
            if not self._intact(vals):
                raise ValueError("the shared namespace takes only intact full-precision content")
            root = self._shared_root(namespace, create=True)
        else:
            assert session_id is not None and key is not None
            root = self._sessions.get(key)
            if root is None:
                root = self._sessions[key] = self._new_root(session_id)
        now = next(self._clock)
        node, pos = root, 0
        while pos < n:
            child = node.children.get(int(tokens[pos]))
            if child is None:
                child = TreeNode(
                    key=tokens[pos:].clone(),
                    value=vals[:, pos:].clone(),
                    parent=node,
                    session_id=session_id,
                    last_access=now,
                )
                self.allocator.incref(child.value)
                node.children[int(tokens[pos])] = child
                return child
            m = _common_prefix_len(child.key, tokens[pos:])
            if m < len(child):
                child = self._split(child, m)
            if not shared:
                self._overwrite(child, vals[:, pos : pos + m])
            child.last_access = now
            node, pos = child, pos + m
        return node

    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from LRU eviction (SGLang ``inc_lock_ref``)."""
        while node is not None and not node.is_root:
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        """Undo one :meth:`lock` (SGLang ``dec_lock_ref``). Works on detached nodes too."""
        while node is not None and not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of a prefix-cache node that is not locked")
            node.lock_ref -= 1
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_cells: int) -> int:
        """Delete least-recently-used unlocked leaves, in every namespace, until ``num_cells``
        cells (summed over columns) went back to the free lists or nothing evictable is left.
        Returns cells freed (a node whose cells other holders still reference frees fewer)."""
        if num_cells <= 0:
            return 0
        return self.evict_until(lambda freed: freed >= num_cells)

    def evict_until(self, enough: Callable[[int], bool]) -> int:
        """Delete least-recently-used unlocked leaves until ``enough(cells freed so far)``
        holds or nothing evictable is left; returns cells freed."""
        if enough(0):
            return 0
        tie = itertools.count()
        heap = [
            (n.last_access, next(tie), n)
            for _, _, n in self.iter_nodes()
            if not n.children and n.lock_ref == 0
        ]
        heapq.heapify(heap)
        freed = 0
        while heap and not enough(freed):
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += self._delete_leaf(node)
            if (
                parent is not None
                and not parent.is_root
                and not parent.children
                and parent.lock_ref == 0
            ):
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        self._drop_empty_sessions()
        return freed

    def end_session(self, session_id: str, namespace: str | None = None) -> int:
        """Drop the session's namespace (locked nodes too: in-flight requests keep their own
        references). Returns slots freed."""
        root = self._sessions.pop(_ns_key(namespace, session_id), None)
        return 0 if root is None else self._drop_tree(root)

    def flush(self) -> int:
        """Drop every namespace, shared included (SGLang ``reset``). Returns slots freed."""
        freed = sum(self._drop_tree(r) for r in self._sessions.values())
        self._sessions.clear()
        freed += self._drop_tree(self._shared)
        self._shared = self._new_root(None)
        return freed

    # ------------------------------------------------------------ private
    def _shared_root(self, namespace: str | None, create: bool = False) -> TreeNode:
        """The shared root of a tenant namespace (an empty detached root when it has none)."""
        if namespace is None:
            return self._shared
        root = self._sessions.get((namespace, None))
        if root is None:
            root = self._new_root(None)
            if create:
                self._sessions[(namespace, None)] = root
        return root

    def _new_root(self, session_id: str | None) -> TreeNode:
        return TreeNode(
            key=torch.empty(0, dtype=torch.int64),
            value=torch.empty(self.num_columns, 0, dtype=torch.int64),
            parent=None,
            session_id=session_id,
        )

    def _peek(self, root: TreeNode, tokens: torch.Tensor) -> int:
        """Matched length, without changing the tree."""
        node, pos, n = root, 0, int(tokens.numel())
        while pos < n:
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            m = _common_prefix_len(child.key, tokens[pos:])
            pos += m
            if m < len(child):
                break
            node = child
        return pos

    def _walk(self, root: TreeNode, tokens: torch.Tensor) -> list[TreeNode]:
        """Nodes covering exactly ``tokens`` (known to be cached), splitting the last one."""
        now = next(self._clock)
        path: list[TreeNode] = []
        node, pos, n = root, 0, int(tokens.numel())
        while pos < n:
            child = node.children[int(tokens[pos])]
            m = _common_prefix_len(child.key, tokens[pos:])
            if m < len(child):
                child = self._split(child, m)
            child.last_access = now
            path.append(child)
            node, pos = child, pos + m
        return path

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after ``m`` tokens; returns the new upper node (holds no new refs)."""
        parent = child.parent
        assert parent is not None and 0 < m < len(child)
        upper = TreeNode(
            key=child.key[:m].clone(),
            value=child.value[:, :m].clone(),
            parent=parent,
            session_id=child.session_id,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
        )
        upper.children[int(child.key[m])] = child
        parent.children[int(child.key[0])] = upper
        child.key = child.key[m:].clone()
        child.value = child.value[:, m:].clone()
        child.parent = upper
        return upper

    def _overwrite(self, node: TreeNode, value: torch.Tensor) -> None:
        """Replace a session node's cells (latest turn wins); references move along."""
        self.allocator.incref(value)
        self.allocator.decref(node.value)
        node.value = value.clone()

    def _delete_leaf(self, node: TreeNode) -> int:
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[int(node.key[0])]
        return self.allocator.decref(node.value)

    def _drop_tree(self, root: TreeNode) -> int:
        held: list[torch.Tensor] = []
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            held.append(node.value)
            stack.extend(node.children.values())
        root.children = {}
        return self.allocator.decref(torch.cat(held, dim=1)) if held else 0

    def _drop_empty_sessions(self) -> None:
        for sid in [s for s, r in self._sessions.items() if not r.children]:
            del self._sessions[sid]
