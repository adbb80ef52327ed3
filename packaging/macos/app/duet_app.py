"""Duet.app's entry point: the `duet` command line inside an app bundle.

Run as `Duet.app/Contents/MacOS/Duet ARGS...` it is `duet ARGS...`; opened from the Finder (no
arguments) it runs `duet serve`. Its purpose is the bundle's Info.plist: a process started from it
(the launchd agent of `duet service install --app /Applications/Duet.app`) is attributed to an app
that declares NSLocalNetworkUsageDescription and NSBonjourServices, so macOS's Local Network
Privacy can ask for, and remember, permission for mDNS and LAN peers.
"""

import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["serve"]))
