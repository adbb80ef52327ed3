"""Radix index over KV blocks: a trie whose edges are whole blocks of token ids.

``match`` walks the trie along a prompt and returns the block ids of the longest cached
full-block prefix; ``insert`` adds a sequence's full blocks; ``remove_block`` drops a
block (the allocator evicts it) together with every descendant, which can no longer be
reached. Reference counts and LRU order live in the allocator, not here.

A finished sequence's last block is usually part full: ``insert`` may index it as a *tail*, a leaf
whose key is the block's first ``n < block_size`` tokens. ``match_tail`` then finds, after a
full-block hit, the block below it (a tail or a full block) that shares the most of the prompt's
next tokens: the KV of a block's first ``n`` positions depends only on the tokens up to them, so a
new sequence may copy that block and skip those ``n`` tokens. A chat's next turn starts with the
previous turn's prompt and reply, which end mid-block (SGLang's radix cache is token-grained for
the same reason); the allocator keeps such a block read-only, so whoever writes on copies it.

A *cache salt* gives a separate trie: blocks inserted under one salt are matched only by requests
with the same salt (vLLM's ``cache_salt``), so one client cannot learn from ``cached_tokens``
whether another's prompt began with a guessed prefix. ``None`` is the common, unsalted trie.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    block: int
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)  # full blocks
    tails: dict[tuple[int, ...], _Node] = field(default_factory=dict)  # part-full leaves
    salt: str | None = None

    def below(self) -> list[_Node]:
        return [*self.children.values(), *self.tails.values()]


class PrefixIndex:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.min_tail = max(1, block_size // 4)  # the fewest tokens match_tail takes
        self.root = _Node((), 0, None)
        self._salted: dict[str, _Node] = {}  # salt -> the root of its own trie
        self._by_block: dict[int, _Node] = {}

    def __len__(self) -> int:
        return len(self._by_block)

    def contains_block(self, block: int) -> bool:
        return block in self._by_block

    def _chunks(self, tokens: list[int], max_tokens: int):
        bs = self.block_size
        for i in range(0, min(len(tokens), max_tokens) // bs * bs, bs):
            yield tuple(tokens[i : i + bs])

    def _root(self, salt: str | None) -> _Node | None:
        """The root of ``salt``'s trie, or None when nothing was indexed under that salt."""
        if salt is None:
            return self.root
        return self._salted.get(salt)

    def _root_creating(self, salt: str | None) -> _Node:
        """The root of ``salt``'s trie, created empty when the salt is new."""
        if salt is None:
            return self.root
        if salt not in self._salted:
            self._salted[salt] = _Node((), 0, None, salt=salt)
        return self._salted[salt]

    def salt_of(self, block: int) -> str | None:
        return self._by_block[block].salt

    def match(self, tokens: list[int], max_tokens: int | None = None, salt: str | None = None) -> list[int]:
        node = self._root(salt)
        out: list[int] = []
        if node is None:
            return out
        for key in self._chunks(tokens, len(tokens) if max_tokens is None else max_tokens):
            node = node.children.get(key)
            if node is None:
                break
            out.append(node.block)
        return out

    def match_tail(
        self, tokens: list[int], blocks: list[int], max_tokens: int, salt: str | None = None
    ) -> tuple[int, int] | None:
        """After ``blocks``, the full-block hit of ``tokens`` (``match``): ``(block, n)`` for the
        block below it whose first ``n`` tokens are the most of ``tokens[start:max_tokens]``
        (``start`` = the hit's tokens), or None. ``n`` is at least ``min_tail`` (a quarter block):
        a copied block that saves a token or two saves nothing, and prompts that merely share a
        first token by chance would take their KV from whichever came first. Below a node with
        very many children (a root that many prompts diverge from) only tails are compared."""
        node = self._by_block[blocks[-1]] if blocks else self._root(salt)
        if node is None:
            return None
        start = len(blocks) * self.block_size
        want = tokens[start : min(max_tokens, start + self.block_size)]
        candidates = node.below() if len(node.children) <= 64 else list(node.tails.values())
        best: tuple[int, int] | None = None
        for cand in candidates:
            n = 0
            for a, b in zip(cand.key, want, strict=False):
                if a != b:
                    break
                n += 1
            if n >= self.min_tail and (best is None or n > best[1]):
                best = (cand.block, n)
        return best

    def insert(self, tokens: list[int], blocks: list[int], salt: str | None = None) -> None:
        """Index ``blocks[i]`` as holding ``tokens[i*bs:(i+1)*bs]`` after the preceding blocks,
        and, where ``tokens`` ends mid-block and ``blocks`` has that block, it as a tail.

        Where a prefix is already cached under another block, the existing entry wins and the
        new block simply stays private to its sequence.
        """
        node = root = self._root_creating(salt)
        full = 0
        for key, block in zip(self._chunks(tokens, len(tokens)), blocks, strict=False):
            full += 1
            child = node.children.get(key)
            if child is None:
                if block in self._by_block:  # the block already sits elsewhere in the tree
                    break
                child = _Node(key, block, node, salt=salt)
                node.children[key] = child
                self._by_block[block] = child
            elif child.block != block:
                node = child
                continue
            node = child
        else:
            key = tuple(tokens[full * self.block_size :])
            fits = 0 < len(key) < self.block_size and full < len(blocks)
            if fits and blocks[full] not in self._by_block and key not in node.tails:
                node.tails[key] = self._by_block[blocks[full]] = _Node(key, blocks[full], node, salt=salt)
        if salt is not None and not root.children and not root.tails:
            del self._salted[salt]  # nothing was indexed under this salt

    def remove_block(self, block: int) -> list[int]:
        """Remove a block and its subtree from the index; returns every block removed."""
        if block not in self._by_block:
            return []
        removed = self.subtree(block)
        node = self._by_block[block]
        parent = node.parent
        assert parent is not None  # only roots have no parent, and roots are never in _by_block
        if len(node.key) == self.block_size:
            del parent.children[node.key]
        else:
            del parent.tails[node.key]
        for b in removed:
            del self._by_block[b]
        if node.salt is not None and not parent.children and not parent.tails and parent.parent is None:
            del self._salted[node.salt]  # the salt's trie is empty: forget the salt
        return removed

    def subtree(self, block: int) -> list[int]:
        """The block and every block below it in the trie."""
        out: list[int] = []
        stack = [self._by_block[block]]
        while stack:
            n = stack.pop()
            out.append(n.block)
            stack.extend(n.below())
        return out

    def is_tail(self, block: int) -> bool:
        return len(self._by_block[block].key) < self.block_size

    def blocks(self, salted: bool = True, tails: bool = True) -> list[int]:
        """Every indexed block; ``salted=False`` leaves out blocks cached under a salt, ``tails=False``
        the part-full ones."""
        bs = self.block_size
        return [
            b for b, n in self._by_block.items() if (salted or n.salt is None) and (tails or len(n.key) == bs)
        ]

    def path_tokens(self, block: int) -> list[int]:
        """All tokens from the root through ``block`` (used as the disk tier's key)."""
        node, parts = self._by_block[block], []
        while node is not None and node.parent is not None:
            parts.append(node.key)
            node = node.parent
        return [t for key in reversed(parts) for t in key]

    def check_invariants(self) -> None:
        seen = 0
        stack = [n for root in (self.root, *self._salted.values()) for n in root.below()]
        assert all(root.below() for root in self._salted.values())
        while stack:
            n = stack.pop()
            seen += 1
            assert self._by_block.get(n.block) is n
            assert n.parent is not None and n.salt == n.parent.salt
            if len(n.key) == self.block_size:
                assert n.parent.children.get(n.key) is n
            else:
                assert 0 < len(n.key) < self.block_size and not n.below()
                assert n.parent.tails.get(n.key) is n
            stack.extend(n.below())
        assert seen == len(self._by_block)


def prefix_hash(tokens: list[int]) -> str:
    """Stable content hash of a token prefix (file names of the disk tier)."""
    return hashlib.sha256(struct.pack(f"<{len(tokens)}I", *tokens)).hexdigest()
