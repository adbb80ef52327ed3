"""The process's open-file limit, raised at start by the commands that accept connections
(``duet serve``, ``duet peer serve``): a flood of connections then meets their own caps, not
EMFILE."""

from __future__ import annotations

import resource


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (macOS caps it lower); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in (hard, 1 << 20, 10240):
        if want == resource.RLIM_INFINITY or want <= soft or (hard != resource.RLIM_INFINITY and want > hard):
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            continue
        return want
    return soft
