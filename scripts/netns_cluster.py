#!/usr/bin/env python
"""The namespace cluster as a command (fairring_pg/tools/netns_cluster.py says what it
does; installed, it is also `fairring-netns-cluster`)."""

import sys

from fairring_pg.tools.netns_cluster import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
