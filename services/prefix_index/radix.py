"""Which executors hold which KV pages: a radix tree over chained page hashes (pure; no NATS).

One node per page. A page's hash is chained (``common.page_hash``): it names the page's tokens
*and* every token before them, so a node has exactly one parent and the path from the root to
a node spells a prompt prefix, one page per edge (as in Dynamo's KV router and SGLang's radix
cache, with hashes for edge labels). Each node records the executors holding that page.

``match`` walks a prompt's page hashes down from the root: an executor's overlap is the number
of leading pages it holds *without a gap*, which is exactly what its local prefix cache can
reuse (an executor that lost page 3 cannot use its page 4).

Invariants (``check``): a node is in the tree while some executor holds it or it has
children; ``held[e]`` is exactly the set of nodes listing ``e``. A page stored before its parent
is known (events of several executors interleave; a parent may be evicted everywhere while a
child lives on) hangs under a placeholder parent with no holders, detached from the root until
the parent itself is stored.
"""

from __future__ import annotations

from collections.abc import Iterable

from common.page_hash import ROOT_HASH


class _Node:
    __slots__ = ("children", "executors", "hash", "parent")

    def __init__(self, page_hash: int, parent: _Node | None) -> None:
        self.hash = page_hash
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.executors: set[str] = set()


class RadixTree:
    def __init__(self) -> None:
        self.root = _Node(ROOT_HASH, None)
        self.nodes: dict[int, _Node] = {}
        self.held: dict[str, set[int]] = {}

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def store(self, executor: str, page_hash: int, parent_hash: int) -> bool:
        """``executor`` now holds the page ``page_hash``, whose prefix ends in ``parent_hash``.

        False, and nothing changes, for a page that would be its own ancestor (or the root):
        chained hashes never do that, but a corrupt or forged batch could, and a cycle is
        cut off from the root and never pruned."""
        if page_hash in (ROOT_HASH, parent_hash):
            return False
        node = self.nodes.get(page_hash)
        if node is None:
            node = self.nodes[page_hash] = _Node(page_hash, None)
        if node.parent is None:  # new, or a placeholder whose parent is now known: attach it
            parent = self.root if parent_hash == ROOT_HASH else self._node(parent_hash)
            if node.children and self._descends_from(parent, node):
                return False  # (the parent was known: it is in the node's subtree)
            node.parent = parent
            parent.children[page_hash] = node
        node.executors.add(executor)
        self.held.setdefault(executor, set()).add(page_hash)
        return True

    @staticmethod
    def _descends_from(node: _Node, ancestor: _Node) -> bool:
        """Is ``ancestor`` on ``node``'s path up (a placeholder's subtree is detached, so the
        walk ends at the root or at a placeholder)? Only a placeholder with children can
        be an ancestor of anything: a new node is checked for free."""
        walk: _Node | None = node
        while walk is not None:
            if walk is ancestor:
                return True
            walk = walk.parent
        return False

    def evict(self, executor: str, page_hash: int) -> bool:
        """``executor`` no longer holds ``page_hash``; False if it was not known to."""
        held = self.held.get(executor)
        if held is None or page_hash not in held:
            return False
        held.discard(page_hash)
        if not held:
            del self.held[executor]
        node = self.nodes[page_hash]
        node.executors.discard(executor)
        self._prune(node)
        return True

    def clear(self, executor: str) -> int:
        """Forget every page of ``executor`` (it restarted, left, or sends a snapshot)."""
        hashes = self.held.pop(executor, set())
        for page_hash in hashes:
            node = self.nodes[page_hash]
            node.executors.discard(executor)
            self._prune(node)
        return len(hashes)

    def match(self, page_hashes: Iterable[int]) -> dict[str, int]:
        """For each executor holding the first page: how many leading pages it holds."""
        overlaps: dict[str, int] = {}
        node = self.root
        active: set[str] | None = None  # executors that hold every page so far
        for depth, page_hash in enumerate(page_hashes, start=1):
            child = node.children.get(page_hash)
            if child is None:
                break
            active = set(child.executors) if active is None else active & child.executors
            if not active:
                break
            for executor in active:
                overlaps[executor] = depth
            node = child
        return overlaps

    def pages_of(self, executor: str) -> set[int]:
        return set(self.held.get(executor, ()))

    def view(self) -> dict[str, set[int]]:
        """Every executor's pages (a copy)."""
        return {executor: set(hashes) for executor, hashes in self.held.items()}

    def _node(self, page_hash: int) -> _Node:
        node = self.nodes.get(page_hash)
        if node is None:  # placeholder: parent unknown until the page itself is stored
            node = self.nodes[page_hash] = _Node(page_hash, None)
        return node

    def _prune(self, node: _Node | None) -> None:
        while node is not None and node is not self.root:
            if node.executors or node.children:
                return
            del self.nodes[node.hash]
            parent = node.parent
            if parent is not None:
                del parent.children[node.hash]
            node = parent

    def check(self) -> None:
        """Raise AssertionError if the invariants in the module docstring do not hold."""
        for page_hash, node in self.nodes.items():
            assert node.hash == page_hash
            assert node.executors or node.children, f"dangling node {page_hash:x}"
            if node.parent is not None:
                assert node.parent.children.get(page_hash) is node
                assert node.parent is self.root or node.parent.hash in self.nodes
            for executor in node.executors:
                assert page_hash in self.held.get(executor, ())
        for executor, hashes in self.held.items():
            assert hashes, f"empty holder set for {executor}"
            for page_hash in hashes:
                assert executor in self.nodes[page_hash].executors
