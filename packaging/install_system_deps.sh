#!/usr/bin/env bash
# System packages Duet uses on Debian/Ubuntu, installed when we can (root + apt); never fatal.
# - libopenblas0-pthread: `duet` preloads it in place of the reference BLAS bundled with the mlx[cpu] wheel
#   (~15x faster CPU prefill); without it Duet runs, slower, and says which BLAS is active.
# - tmux: the terminal chat's end-to-end test drives `duet chat` in tmux.
set -u
[ "$(uname -s)" = Linux ] || exit 0
want=()
ls /usr/lib/*/openblas-pthread/libopenblas*.so* >/dev/null 2>&1 || want+=(libopenblas0-pthread)
command -v tmux >/dev/null || want+=(tmux)
[ ${#want[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get install -y -q "${want[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${want[@]}" >/dev/null 2>&1; }) \
    && echo "installed ${want[*]}" || echo "could not install ${want[*]}; see packaging/install_system_deps.sh"
else
  echo "note: install the Debian/Ubuntu packages ${want[*]} for fast CPU inference and the chat's tmux test"
fi
