"""`python -m mhcpipe ...` is the `mhcpipe` command."""
import sys

from mhcpipe.cli import main

sys.exit(main())
