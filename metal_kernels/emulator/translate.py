"""Translate the Metal Shading Language subset used by custom kernels into C++ for the emulator.

The translation is deliberately small; everything else is done by ``msl_shim.h``:

* comments are removed (line structure kept) so that rewrites never see them;
* ``[[...]]`` attributes (``[[kernel]]``, ``[[buffer(0)]]``, ``[[thread_position_in_grid]]``,
  ``[[host_name(..)]]``, ``[[function_constant(..)]]``) are stripped;
* ``#include <metal_*>`` lines are dropped (the shim provides the library);
* ``threadgroup T name[N]...;`` declarations become references into the per-threadgroup arena,
  shared by all threads of the group; other ``threadgroup`` qualifiers vanish through a macro;
* half literals (``1.0h``) become ``((half)(1.0))``;
* MLX's explicit template instantiation line is dropped (the wrapper instantiates the kernel).
"""

from __future__ import annotations

import re

_COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S)
_METAL_INCLUDE_RE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<metal_\w+>[^\n]*$", re.M)
_METAL_PRAGMA_RE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+METAL[^\n]*$", re.M)
_TG_DECL_RE = re.compile(
    r"\bthreadgroup\s+(?P<type>[A-Za-z_][\w:<>\s]*?)\s+(?P<name>[A-Za-z_]\w*)\s*"
    r"(?P<dims>(?:\[[^\[\];]*\]\s*)*);"
)
_HALF_LITERAL_RE = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b")
_INSTANTIATE_RE = re.compile(r"^[ \t]*template\s+decltype\s*\([^;]*;", re.M)


def strip_comments(src: str) -> str:
    def repl(m: re.Match[str]) -> str:
        s = m.group(0)
        if s.startswith("/"):
            return " " if s.startswith("//") else "\n" * s.count("\n") + " "
        return s  # string or character literal: keep

    return _COMMENT_RE.sub(repl, src)


def strip_attributes(src: str) -> str:
    """Remove every ``[[ ... ]]`` attribute (brackets inside are balanced)."""
    out: list[str] = []
    i = 0
    n = len(src)
    while i < n:
        j = src.find("[[", i)
        if j < 0:
            out.append(src[i:])
            break
        out.append(src[i:j])
        depth = 0
        k = j
        while k < n:
            c = src[k]
            if c == "[":
                depth += 1
            elif c == "]":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        if depth != 0:
            raise ValueError("unbalanced [[ attribute in kernel source")
        out.append(" ")
        i = k + 1
    return "".join(out)


def _rewrite_threadgroup_decls(src: str) -> tuple[str, int]:
    count = 0

    def repl(m: re.Match[str]) -> str:
        nonlocal count
        t = " ".join(m.group("type").split())
        if t in ("const", "static") or t.endswith(("*", "&")):
            return m.group(0)
        dims = "".join(m.group("dims").split())
        ident = count
        count += 1
        return f"auto& {m.group('name')} = *::emu::tg_var<{t}{dims}>({ident});"

    return _TG_DECL_RE.sub(repl, src), count


def translate(metal_source: str) -> str:
    """Return C++ that compiles against ``msl_shim.h``."""
    src = strip_comments(metal_source)
    src = _METAL_INCLUDE_RE.sub("", src)
    src = _METAL_PRAGMA_RE.sub("", src)
    src = strip_attributes(src)
    src = _INSTANTIATE_RE.sub("", src)
    src, _ = _rewrite_threadgroup_decls(src)
    src = _HALF_LITERAL_RE.sub(r"((half)(\1))", src)
    return src
