"""Hand-made mutation testing of the engine core: re-apply each one-line bug and run its tests.

Each mutant is (file, exact original snippet, replacement). For every mutant the script copies
the repository (without .venv and .git) to a temporary directory, applies the mutant there (the
working tree is never touched), runs the test files that guard that code in the copy and reports
whether some test failed (caught) or all passed (survived). A snippet that is not found exactly
once is an error: the code moved, so the mutant must be updated, never silently skipped.

    .venv/bin/python tests/mutants.py                    # every mutant
    .venv/bin/python tests/mutants.py --only NAME ...    # some of them
    .venv/bin/python tests/mutants.py --list             # names and descriptions
    .venv/bin/python tests/mutants.py --baseline         # first run the unmutated copy
    .venv/bin/python tests/mutants.py --tests-at REV     # with tests/ as of a git revision
    .venv/bin/python tests/mutants.py --only NAME --tests tests/test_x.py   # other test files

``--tests-at`` measures an older suite against today's code (e.g. the score before a test was
written); test files that did not exist at that revision are left out. ``--baseline`` runs every
chosen test file on the unmutated copy first; tests that fail there (an older suite that no
longer fits today's code) are listed and deselected from the mutant runs, since they would
"catch" every mutant. Exit status: 0 when every mutant was caught, 1 when some survived, 2 on a
setup error. See tests/mutants.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPY_IGNORE = shutil.ignore_patterns(
    ".venv",
    ".git",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    "*.egg-info",
    "build",
    "dist",
)
PER_TEST_TIMEOUT_S = 120  # a mutant that makes a test hang fails it instead of stalling the run
PER_MUTANT_TIMEOUT_S = 900

# Test files per guarded module, the direct guards first (runs stop at the first failure).
SCHEDULER = (
    "tests/test_scheduler.py",
    "tests/test_scheduler_properties.py",
    "tests/test_prefix_cache.py",
    "tests/test_engine_tiny.py",
    "tests/test_server.py",
)
ALLOCATOR = (
    "tests/test_kv_pool_growth.py",  # first: its direct checks fail fast where a property test may hang
    "tests/test_block_allocator.py",
    "tests/test_scheduler_properties.py",
    "tests/test_scheduler.py",
    "tests/test_prefix_cache.py",
    "tests/test_engine_tiny.py",
)
ENGINE = ("tests/test_prefix_cache.py", "tests/test_engine_tiny.py", "tests/test_server.py")
SAMPLER = ("tests/test_sampler.py", "tests/test_engine_tiny.py", "tests/test_server.py")
ATTENTION = ("tests/test_engine_tiny.py", "tests/test_kv_pool_in_place.py", "tests/test_prefix_cache.py")
STOPS = ("tests/test_stop_strings.py", "tests/test_engine_tiny.py", "tests/test_server.py")
KV_SOURCES = ("tests/test_kv_source.py", "tests/test_remote_prefill_engine.py", "tests/test_engine_tiny.py")
DISK = (
    "tests/test_prefix_cache.py",
    "tests/test_data_at_rest.py",
    "tests/test_engine_tiny.py",
    "tests/test_cache_salt.py",
)
REQUESTS = ("tests/test_request_caps.py", "tests/test_engine_tiny.py", "tests/test_server.py")
OPENAI = ("tests/test_server.py", "tests/test_request_caps.py")
ANTHROPIC = ("tests/test_server_anthropic.py",)
RESPONSES = ("tests/test_server_responses.py",)
EMBEDDINGS = ("tests/test_server_embeddings.py",)
TOKENIZER = ("tests/test_control_tokens.py", "tests/test_reply_reuse.py", "tests/test_gguf_tokenizer.py")
PEER_TRUST = ("tests/test_peer_local_auth.py", "tests/test_peer_tls.py", "tests/test_peer_link.py")
PEER_CLIENT = ("tests/test_peer_wire.py", "tests/test_peer_bounds.py", "tests/test_peer_faults.py")
PEER_SERVER = ("tests/test_peer_wire.py", "tests/test_peer_bounds.py", "tests/test_peer_accept.py")
CPU_KERNELS = ("tests/test_cpu_kernels.py", "tests/test_cpu_paged_attention.py")
METAL = (
    "tests/test_metal_paged_attention.py",
    "tests/test_metal_qmv.py",
    "tests/test_metal_pool_paths.py",
    "tests/test_metal_engine_windows.py",
)


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    why: str


MUTANTS = [
    Mutant(
        "preempt-oldest",
        "mlx_engine/scheduler.py",
        "(s for s in self.running if s.request_id not in step.tokens), key=place.__getitem__",
        "(s for s in self.running if s.request_id not in step.tokens), key=lambda s: -place[s]",
        SCHEDULER,
        "out of blocks, the oldest running sequence is preempted instead of the newest",
    ),
    Mutant(
        "preempted-to-back",
        "mlx_engine/scheduler.py",
        "self.waiting.appendleft(seq)",
        "self.waiting.append(seq)",
        SCHEDULER,
        "a preempted sequence goes to the back of the queue instead of the front",
    ),
    Mutant(
        "prefix-match-whole-prompt",
        "mlx_engine/scheduler.py",
        "hit = self.alloc.match_prefix(seq.tokens, end, seq.cache_salt)",
        "hit = self.alloc.match_prefix(seq.tokens, end + 1, seq.cache_salt)",
        SCHEDULER,
        "a block-aligned prompt is matched in full, leaving no token to compute logits from",
    ),
    Mutant(
        "held-followers-dropped",
        "mlx_engine/scheduler.py",
        "self.waiting.extendleft(reversed(held))",
        "pass",
        SCHEDULER,
        "n > 1 choices held for their leader are never put back in the queue",
    ),
    Mutant(
        "admit-past-max-running",
        "mlx_engine/scheduler.py",
        "self.num_active < self.cfg.max_running",
        "self.num_active <= self.cfg.max_running",
        SCHEDULER,
        "one more sequence than max_running is admitted",
    ),
    Mutant(
        "running-ignores-budget",
        "mlx_engine/scheduler.py",
        "n = min(n, budget)\n            while not self._grow(seq, n, step.copies):",
        "pass\n            while not self._grow(seq, n, step.copies):",
        SCHEDULER,
        "a running prefill takes a whole chunk even past the step's token budget",
    ),
    Mutant(
        "release-registers-uncomputed",
        "mlx_engine/scheduler.py",
        "full, tail = divmod(seq.num_computed, self.bs)",
        "full, tail = divmod(len(seq.tokens), self.bs)",
        SCHEDULER,
        "a released sequence registers blocks whose KV was never (fully) computed",
    ),
    Mutant(
        "can-ever-fit-off-by-one",
        "mlx_engine/scheduler.py",
        "return -(-num_tokens // self.bs) <= self.alloc.num_blocks - 1",
        "return -(-num_tokens // self.bs) <= self.alloc.num_blocks",
        SCHEDULER,
        "a prompt one block larger than the pool is accepted (and then waits forever)",
    ),
    Mutant(
        "register-partial-block",
        "mlx_engine/scheduler.py",
        "full = min(seq.num_computed, seq.num_verified) // self.bs",
        "full = -(-min(seq.num_computed, seq.num_verified) // self.bs)",
        SCHEDULER,
        "a block is registered in the prefix index before it is fully computed",
    ),
    Mutant(
        "landed-in-one-layer",
        "mlx_engine/kv_cache/kv_source.py",
        "return min(r.end_from(t) for r in self.layers)",
        "return max(r.end_from(t) for r in self.layers)",
        KV_SOURCES,
        "a loading sequence counts tokens as computed (and indexes their blocks) once one layer landed",
    ),
    Mutant(
        "cancelled-load-stays-live",
        "mlx_engine/scheduler.py",
        "st = self.live_loads.pop(load_id)\n                assert st is not None",
        "st = self.live_loads.get(load_id)\n                assert st is not None",
        KV_SOURCES,
        "late frames of a cancelled load are still written, into blocks that were freed and reused",
    ),
    Mutant(
        "last-token-in-its-chunk",
        "mlx_engine/scheduler.py",
        "if self.cfg.last_token_alone and not seq.exact_grid and seq.num_computed < seq.num_prompt - 1:",
        "if False:",
        KV_SOURCES,
        "a decoder with a peer computes the prompt's last token inside its last chunk (logits differ from remote)",
    ),
    Mutant(
        "kv-apply-unbounded",
        "mlx_engine/engine/kv_transfer.py",
        "if isinstance(m, KVLayer) and budget <= 0:",
        "if False:",
        KV_SOURCES,
        "every queued KV frame is applied before the next step, stalling decode streams while a load arrives",
    ),
    Mutant(
        "cached-tokens-dropped",
        "mlx_engine/engine/outputs.py",
        "cached_tokens=seq.num_cached",
        "cached_tokens=0",
        ENGINE,
        "usage.cached_tokens reports no prefix hit instead of the request's own",
    ),
    Mutant(
        "sliding-window-dropped",
        "mlx_engine/kv_cache/paged_attention.py",
        "m = m & (self._k_pos > self._q_pos - window)",
        "pass",
        ATTENTION,
        "the sliding-window condition of the attention mask is dropped",
    ),
    Mutant(
        "min-p-before-temperature",
        "mlx_engine/sampling/sampler.py",
        "math.log(p.min_p) if p.min_p > 0",
        "math.log(p.min_p) / p.temperature if p.min_p > 0",
        SAMPLER,
        "min_p's threshold is taken on the logits before temperature scaling",
    ),
    Mutant(
        "evict-newest-first",
        "mlx_engine/kv_cache/block_allocator.py",
        "b, _ = self._free.popitem(last=False)",
        "b, _ = self._free.popitem(last=True)",
        ALLOCATOR,
        "allocation evicts the most recently released cached block instead of the coldest",
    ),
    Mutant(
        "free-head-first",
        "mlx_engine/kv_cache/block_allocator.py",
        "for b in reversed(blocks):",
        "for b in blocks:",
        ALLOCATOR,
        "a sequence's first blocks are released first, so its shared prefix is evicted before its tail",
    ),
    Mutant(
        "revived-block-stays-in-free-queue",
        "mlx_engine/kv_cache/block_allocator.py",
        "if self.ref[b] == 0:\n            self._free.pop(b)",
        "if self.ref[b] == 0:\n            self._free.get(b)",
        ALLOCATOR,
        "a cached block taken by a prefix hit stays allocatable (its KV can be overwritten)",
    ),
    Mutant(
        "stop-tie-goes-to-shorter",
        "mlx_engine/tokenization/stop_strings.py",
        "start + len(stop) < best[0]",
        "start + len(stop) <= best[0]",
        STOPS,
        "of two stop strings ending at the same place, the shorter wins",
    ),
    Mutant(
        "register-proposed-tokens",
        "mlx_engine/scheduler.py",
        "full = min(seq.num_computed, seq.num_verified) // self.bs",
        "full = seq.num_computed // self.bs",
        ("tests/test_scheduler_properties.py",),
        "a block holding unverified proposals enters the prefix cache, then is rewritten on rollback",
    ),
    Mutant(
        "keep-rejected-proposals",
        "mlx_engine/speculative/verify.py",
        "while n <= len(proposals) and n < len(results) and results[n - 1].token_id == proposals[n - 1]:",
        "while n <= len(proposals) and n < len(results):",
        ("tests/test_speculative.py",),
        "every proposed token is kept, equal to the sampled one or not",
    ),
    # --- issue 30: the engine core ------------------------------------------------------------
    Mutant(
        "disk-skips-block-before-last-token",
        "mlx_engine/kv_cache/prefix_disk.py",
        "while (k + 1) * bs <= end and self.has(",
        "while (k + 1) * bs < end and self.has(",
        DISK,
        "the disk tier skips the block that ends right before a prompt's last token (33 tokens: 17 recomputed, not 1)",
    ),
    Mutant(
        "disk-trim-drops-newest",
        "mlx_engine/kv_cache/prefix_disk.py",
        "for _, size, p in sorted(files):",
        "for _, size, p in sorted(files, reverse=True):",
        DISK,
        "over its size cap the disk tier deletes its most recently used files instead of the oldest",
    ),
    Mutant(
        "disk-mac-unchecked",
        "mlx_engine/kv_cache/prefix_disk.py",
        'why = None if signed else "not signed by this cache"',
        "why = None",
        DISK,
        "a block file whose MAC does not verify (planted, damaged, renamed) is loaded as the model's context",
    ),
    Mutant(
        "disk-flush-salted-blocks",
        "mlx_engine/engine/core.py",
        "index.blocks(salted=False, tails=False)",
        "index.blocks(salted=True, tails=False)",
        DISK,
        "blocks cached under a cache_salt are written to the disk tier at shutdown (keyed by tokens alone)",
    ),
    Mutant(
        "length-one-token-late",
        "mlx_engine/engine/outputs.py",
        "if len(seq.tokens) >= seq.max_total:",
        "if len(seq.tokens) > seq.max_total:",
        ENGINE,
        "a reply runs one token past max_tokens",
    ),
    Mutant(
        "length-cut-drops-held-text",
        "mlx_engine/engine/outputs.py",
        'if end.flush and reason in ("stop", "length"):',
        'if end.flush and reason == "stop":',
        STOPS,
        "a reply cut by max_tokens loses the text the detokenizer and the stop matcher held back",
    ),
    Mutant(
        "stop-token-ids-ignored",
        "mlx_engine/engine/outputs.py",
        "if (tok in self.tokenizer.eos_token_ids and not req.ignore_eos) or tok in req.stop_token_ids:",
        "if tok in self.tokenizer.eos_token_ids and not req.ignore_eos:",
        ENGINE,
        "GenerationRequest.stop_token_ids never stop a generation",
    ),
    Mutant(
        "kv-cache-cap-ignored",
        "mlx_engine/engine/inputs.py",
        "cap = min(self.context_length, self.kv_tokens)",
        "cap = self.context_length",
        ("tests/test_engine_core.py", *REQUESTS),
        "a request without max_tokens may grow past what the whole KV cache holds",
    ),
    Mutant(
        "prompt-filling-context-accepted",
        "mlx_engine/engine/inputs.py",
        "if len(ids) >= self.context_length:",
        "if len(ids) > self.context_length:",
        REQUESTS,
        "a prompt exactly as long as the context is accepted, leaving no room for one reply token",
    ),
    Mutant(
        "fork-of-another-prompt-shares",
        "mlx_engine/engine/core.py",
        "and lead.seq.tokens[: lead.seq.num_prompt] == st.seq.tokens\n",
        "and True\n",
        ("tests/test_engine_tiny.py", "tests/test_cache_salt.py"),
        "a fork_of request whose prompt differs from its leader's shares the leader's prompt KV",
    ),
    Mutant(
        "remote-kv-counted-as-cache-hit",
        "mlx_engine/sequence.py",
        "cached += n if cache else 0",
        "cached += n",
        KV_SOURCES,
        "tokens a remote peer prefilled are reported as prefix-cache hits (usage.cached_tokens)",
    ),
    Mutant(
        "reuse-recounted-after-preemption",
        "mlx_engine/scheduler.py",
        "if not seq.admitted_once:\n            seq.num_cached = seq.num_computed",
        "if True:\n            seq.num_cached = seq.num_computed",
        SCHEDULER,
        "a preempted sequence's cached_tokens (and the engine's hit count) are counted again on re-admission",
    ),
    Mutant(
        "follower-before-leader-computed",
        "mlx_engine/scheduler.py",
        "if lead.status != RUNNING or lead.num_computed < seq.num_prompt - 1:",
        "if lead.status != RUNNING or lead.num_computed < seq.num_prompt - 2:",
        SCHEDULER,
        "an n > 1 choice shares its leader's prompt blocks one token before the leader computed them",
    ),
    # --- issue 30: the server adapters ----------------------------------------------------------
    Mutant(
        "embeddings-all-get-first-vectors",
        "app/server/embeddings.py",
        "                at += len(j.inputs)\n",
        "                pass\n",
        EMBEDDINGS,
        "concurrent embedding requests batched together all get the first request's vectors",
    ),
    Mutant(
        "max-completion-tokens-ignored",
        "app/server/chat.py",
        "requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens",
        "requested = body.max_tokens",
        OPENAI,
        "chat's max_completion_tokens (what today's OpenAI SDKs send) is ignored",
    ),
    Mutant(
        "stream-usage-unasked",
        "app/server/chat.py",
        "self.include_usage = bool(self.stream and body.stream_options and body.stream_options.include_usage)",
        "self.include_usage = bool(self.stream)",
        OPENAI,
        "every chat stream ends with a usage chunk (and usage: null in each chunk), asked for or not",
    ),
    Mutant(
        "usage-prompt-counted-per-choice",
        "app/server/common.py",
        "if i % n == 0:",
        "if True:",
        OPENAI,
        "n > 1 choices bill their shared prompt once per choice",
    ),
    Mutant(
        "n-choices-share-one-seed",
        "app/server/common.py",
        "seed=None if body.seed is None else (body.seed + index) % 2**63,",
        "seed=None if body.seed is None else body.seed % 2**63,",
        OPENAI,
        "n > 1 choices with a seed all sample the same reply",
    ),
    Mutant(
        "reply-cap-ignores-context",
        "app/server/common.py",
        "return None if limit is None else min(limit, context - prompt_len)",
        "return limit",
        OPENAI,
        "max_tokens past the context is passed on instead of capped to what the context leaves",
    ),
    Mutant(
        "server-max-tokens-ignored",
        "app/server/common.py",
        "limit = fewest(requested, server_cap)",
        "limit = requested",
        OPENAI,
        "duet serve --max-tokens does not cap a request that asks for more",
    ),
    Mutant(
        "anthropic-input-tokens-include-cached",
        "app/server/anthropic.py",
        '"input_tokens": u.prompt_tokens - u.cached_tokens,',
        '"input_tokens": u.prompt_tokens,',
        ANTHROPIC,
        "Messages usage counts prefix-cache hits in input_tokens as well as in cache_read_input_tokens",
    ),
    Mutant(
        "anthropic-tool-choice-any-is-auto",
        "app/server/anthropic.py",
        'fields["tool_choice"] = "required"',
        'fields["tool_choice"] = "auto"',
        ANTHROPIC,
        "Messages tool_choice any no longer forces a tool call",
    ),
    Mutant(
        "anthropic-error-result-unmarked",
        "app/server/anthropic.py",
        'return f"Error: {text}" if block.is_error else text',
        "return text",
        ANTHROPIC,
        "a tool_result with is_error reads to the model as a successful result",
    ),
    Mutant(
        "responses-store-false-stored",
        "app/server/responses.py",
        "if self.body.store is not False:",
        "if True:",
        RESPONSES,
        "a response created with store: false is kept (and retrievable)",
    ),
    Mutant(
        "responses-continuation-drops-reply",
        "app/server/responses.py",
        "conversation = [*self.earlier, *to_messages(input_items(self.body), self.tools), reply]",
        "conversation = [*self.earlier, *to_messages(input_items(self.body), self.tools)]",
        RESPONSES,
        "previous_response_id continues without the earlier response's own output",
    ),
    Mutant(
        "responses-input-items-repeat-cursor",
        "app/server/responses.py",
        "items = items[ids.index(after) + 1 :] if after in ids else []",
        "items = items[ids.index(after) :] if after in ids else []",
        RESPONSES,
        "input_items?after=ID pages start with ID itself (each page repeats the previous one's last item)",
    ),
    # --- issue 30: the tokenizer's control tokens ---------------------------------------------
    Mutant(
        "user-control-tokens-parsed",
        "mlx_engine/tokenization/tokenizer.py",
        "        messages = sentinels.swap(messages)\n",
        "        pass\n",
        TOKENIZER,
        "control-token text in a message's content becomes real control tokens (prompt injection)",
    ),
    Mutant(
        "tool-definition-control-tokens-parsed",
        "mlx_engine/tokenization/tokenizer.py",
        "        tools = sentinels.swap(tools)\n",
        "        pass\n",
        TOKENIZER,
        "control-token text inside a tool definition becomes real control tokens",
    ),
    Mutant(
        "control-token-completed-at-the-edge",
        "mlx_engine/tokenization/tokenizer.py",
        "tail = next((k for k in range(len(s) - rest, 0, -1) if s[-k:] in self.prefixes), 0)",
        "tail = 0",
        TOKENIZER,
        "content ending in the start of a control token (`<|im_`) is completed by the template's text",
    ),
    Mutant(
        "bos-doubled",
        "mlx_engine/tokenization/tokenizer.py",
        "and (not ids or ids[0] != self.bos_token_id)",
        "and True",
        TOKENIZER + ("tests/test_engine_bundled.py",),
        "BOS is added again in front of a prompt that starts with it (the template wrote it)",
    ),
    Mutant(
        "text-prompt-parses-control-tokens",
        "mlx_engine/engine/inputs.py",
        "ids = self.tokenizer.encode(request.prompt, add_special_tokens=True, parse_special=False)",
        "ids = self.tokenizer.encode(request.prompt, add_special_tokens=True, parse_special=True)",
        TOKENIZER,
        "a text prompt's control-token text becomes control tokens (only ids may carry them)",
    ),
    # --- issue 30: the peer client and server ---------------------------------------------------
    Mutant(
        "network-link-without-tls-is-plain",
        "peer/trust/link_security.py",
        "        if self.tls is None:\n            raise PeerAuthError(",
        "        if False:\n            raise PeerAuthError(",
        PEER_TRUST,
        "a network connection on a side with no paired machine runs plain TCP instead of being refused",
    ),
    Mutant(
        "lan-address-counts-as-loopback",
        "peer/trust/link_security.py",
        'return ipaddress.ip_address(address.strip("[]").split("%")[0]).is_loopback',
        'return ipaddress.ip_address(address.strip("[]").split("%")[0]).is_private',
        PEER_TRUST,
        "a LAN address gets loopback's local authentication (plain frames over a network) instead of TLS",
    ),
    Mutant(
        "pin-not-checked",
        "peer/trust/link_security.py",
        "if self.expect is not None and peer.fingerprint != self.expect:",
        "if False:",
        PEER_TRUST,
        "a decoder pinned to one paired machine accepts another paired machine at that address",
    ),
    Mutant(
        "decoder-never-pins",
        "peer/peer_link.py",
        "self.security.pin(conn.peer)  # reconnects must reach the same machine",
        "pass",
        PEER_TRUST,
        "a decoder is not pinned to the machine it first reached: another paired machine there later is accepted",
    ),
    Mutant(
        "local-client-trusts-any-listener",
        "peer/trust/local_auth.py",
        'if not hmac.compare_digest(proof, _proof(self._secret, b"server", nonce_c, nonce_s)):',
        "if False:",
        PEER_TRUST,
        "a decoder sends its prompts to a loopback listener that does not hold the user's secret",
    ),
    Mutant(
        "done-with-layers-missing",
        "peer/client.py",
        "        if landed < s.load.end:\n            self._fail(",
        "        if False:\n            self._fail(",
        PEER_CLIENT,
        "a DONE before every layer of the range landed ends the load as complete (unwritten KV is read)",
    ),
    Mutant(
        "busy-retry-after-ignored",
        "peer/client.py",
        "self.link.busy_for(min(max(msg.retry_after_s, 0.5), 60.0))",
        "self.link.busy_for(0)",
        PEER_CLIENT,
        "a BUSY peer is offered the next prompt at once instead of after its retry_after",
    ),
    Mutant(
        "backoff-starts-doubled",
        "peer/connection.py",
        "return min(self.initial_s * 2 ** max(failures - 1, 0), self.max_s)",
        "return min(self.initial_s * 2**failures, self.max_s)",
        PEER_CLIENT,
        "the first retry of a failed peer waits twice the initial backoff",
    ),
    Mutant(
        "success-keeps-backoff",
        "peer/peer_link.py",
        "            self._failures = 0\n",
        "            pass\n",
        PEER_CLIENT,
        "a completed remote prefill does not reset the failure streak: the next failure backs off longer",
    ),
    Mutant(
        "peer-sends-tokens-the-decoder-holds",
        "peer/export_connection.py",
        "lo, hi = max(t0, self.start), min(t1, self.end)",
        "lo, hi = t0, min(t1, self.end)",
        PEER_SERVER,
        "the peer sends KV of tokens before the load's start (the decoder's own prefix hit)",
    ),
    Mutant(
        "peer-exports-past-max",
        "peer/server.py",
        "if len(self._active_exports) >= self.limits.max_exports:",
        "if len(self._active_exports) > self.limits.max_exports:",
        PEER_SERVER,
        "the peer runs one remote prefill more than max_exports at once",
    ),
    Mutant(
        "peer-export-never-pauses",
        "peer/export_connection.py",
        "room = self.queued_bytes < self.cap",
        "room = True",
        PEER_SERVER,
        "an export whose frames wait for a slow link is never paused (its queued bytes grow unbounded)",
    ),
    Mutant(
        "peer-handshakes-per-address-uncapped",
        "peer/server.py",
        "busy = busy or self._handshakes.get(who, 0) >= lim.max_handshakes_per_address",
        "busy = busy or False",
        PEER_SERVER,
        "one address may hold every handshake slot (max_handshakes_per_address not enforced)",
    ),
    # --- issue 30: the kernel wrappers' dispatch --------------------------------------------------
    Mutant(
        "qmm-untransposed-to-kernel",
        "cpu_kernels/qmm.py",
        'usable = transpose and mode == "affine" and biases is not None',
        'usable = mode == "affine" and biases is not None',
        CPU_KERNELS,
        "quantized_matmul(transpose=False) runs the native kernel, which computes x @ w.T",
    ),
    Mutant(
        "kernel-takes-unsupported-layer",
        "cpu_kernels/modules.py",
        "        and SPEC.supports(bits=layer.bits, group_size=layer.group_size, dtype=_scales_dtype(layer))\n",
        "",
        CPU_KERNELS,
        "use_cpu_kernels switches layers of a format the kernel does not take (3-bit, group 16)",
    ),
    Mutant(
        "cpu-attention-window-one-wider",
        "cpu_kernels/paged_attention.py",
        "mask = mask & (pos[None, None, :] > q_pos[:, :, None] - window)",
        "mask = mask & (pos[None, None, :] >= q_pos[:, :, None] - window)",
        CPU_KERNELS,
        "the CPU attention's reference path lets a sliding-window query see one token too many",
    ),
    Mutant(
        "metal-mixed-dtype-pool-to-kernel",
        "metal_kernels/paged_attention.py",
        "    if bits is None and k_pool.dtype != q.dtype:\n",
        "    if False:\n",
        METAL,
        "a pool of another dtype than the queries goes to the Metal kernel, which reads it as the queries' dtype",
    ),
    Mutant(
        "metal-window-off-by-one",
        "metal_kernels/paged_attention.py",
        "visible = visible & (pos >= lens - window)",
        "visible = visible & (pos > lens - window)",
        METAL,
        "the Metal decode attention's reference path keeps window - 1 tokens",
    ),
    Mutant(
        "metal-needs-newer-mlx",
        "metal_kernels/spec.py",
        'return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts) >= MIN_MLX',
        'return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts) > MIN_MLX',
        METAL,
        "the MLX release the Metal kernels need (0.32) is refused, so the kernels never run",
    ),
]


def _test_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONDONTWRITEBYTECODE="1")
    preload = subprocess.run(
        [sys.executable, "-m", "mlx_engine.blas", "--env"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    env.update(kv.partition("=")[::2] for kv in preload)  # LD_PRELOAD (and OPENBLAS_CORETYPE)
    return env


def _copy_tree(dest: Path, tests_at: str | None) -> None:
    shutil.copytree(ROOT, dest, ignore=COPY_IGNORE)
    if tests_at is not None:
        shutil.rmtree(dest / "tests")
        archive = subprocess.run(
            ["git", "archive", tests_at, "tests"], cwd=ROOT, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def _apply(tree: Path, m: Mutant) -> None:
    path = tree / m.file
    text = path.read_text()
    count = text.count(m.original)
    if count != 1:
        raise SystemExit(
            f"mutant {m.name}: its snippet occurs {count} times in {m.file} (expected once); "
            f"the code moved, update the mutant in tests/mutants.py:\n{m.original}"
        )
    path.write_text(text.replace(m.original, m.replacement))


def _check_imports_from(tree: Path, env: dict[str, str]) -> None:
    """The copy's own packages must be the ones imported (not the editable install's)."""
    out = subprocess.run(
        [sys.executable, "-c", "import mlx_engine, tests; print(mlx_engine.__file__)"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if not out.stdout.strip().startswith(str(tree)):
        raise SystemExit(f"the copy imports mlx_engine from {out.stdout.strip() or out.stderr!r}, not {tree}")


def _run_tests(
    tree: Path, tests: tuple[str, ...], env: dict[str, str], deselect: list[str], stop_first: bool = True
) -> tuple[str, str, float]:
    """(outcome, detail, seconds): outcome is caught, survived, hang or no-tests; without
    ``stop_first`` the detail lists every failing test, space-separated."""
    present = [t for t in tests if (tree / t).exists()]
    if not present:
        return "no-tests", "none of its test files exist", 0.0
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        *(["-x"] if stop_first else []),
        "-p",
        "no:cacheprovider",
        "--hypothesis-seed=0",
        "-o",
        f"timeout={PER_TEST_TIMEOUT_S}",
        *(f"--deselect={d}" for d in deselect),
        *present,
    ]
    t0 = time.monotonic()
    try:
        r = subprocess.run(
            cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=PER_MUTANT_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return "hang", f"no result in {PER_MUTANT_TIMEOUT_S} s", time.monotonic() - t0
    dt = time.monotonic() - t0
    out = r.stdout + r.stderr
    if r.returncode == 0:
        return "survived", f"{' '.join(present)} all pass", dt
    failed = list(dict.fromkeys(re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)))
    if not stop_first and failed:
        return "caught", " ".join(failed), dt
    detail = failed[0] if failed else out.strip().splitlines()[-1] if out.strip() else f"exit {r.returncode}"
    if "Timeout" in out:
        return "hang", detail, dt
    return "caught", detail, dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--baseline", action="store_true", help="first check that the unmutated copy passes")
    ap.add_argument("--tests-at", metavar="REV", help="use tests/ as of this git revision")
    ap.add_argument(
        "--tests", nargs="+", metavar="FILE", help="run these test files instead of each mutant's own"
    )
    args = ap.parse_args()

    names = {m.name for m in MUTANTS}
    if args.only and (unknown := set(args.only) - names):
        print(f"unknown mutant(s): {', '.join(sorted(unknown))}; --list shows them", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:36} {m.file:32} {m.why}")
        return 0

    env = _test_env()
    results = []
    deselect: list[str] = []
    with tempfile.TemporaryDirectory(prefix="duet-mutants-") as tmp:
        if args.baseline:
            tree = Path(tmp) / "baseline"
            _copy_tree(tree, args.tests_at)
            _check_imports_from(tree, env)
            files = tuple(args.tests or dict.fromkeys(t for m in chosen for t in m.tests))
            outcome, detail, dt = _run_tests(tree, files, env, [], stop_first=False)
            if outcome == "caught":
                deselect = detail.split()
                detail = "failing on the unmutated tree, deselected: " + " ".join(deselect)
            elif outcome != "survived":
                print(f"the unmutated copy does not run: {outcome} {detail}", file=sys.stderr)
                return 2
            print(f"{'(baseline)':36} {'pass' if outcome == 'survived' else 'FAIL':9} {dt:6.1f}s  {detail}")
            shutil.rmtree(tree)
        for i, m in enumerate(chosen):
            tree = Path(tmp) / f"m{i}"
            _copy_tree(tree, args.tests_at)
            if i == 0:
                _check_imports_from(tree, env)
            _apply(tree, m)
            outcome, detail, dt = _run_tests(tree, tuple(args.tests or m.tests), env, deselect)
            shutil.rmtree(tree)
            results.append((m, outcome))
            print(f"{m.name:36} {outcome:9} {dt:6.1f}s  {detail}", flush=True)
    caught = sum(o in ("caught", "hang") for _, o in results)
    hangs = sum(o == "hang" for _, o in results)
    print(f"\ncaught {caught}/{len(results)}" + (f" ({hangs} only by a hang)" if hangs else ""))
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
