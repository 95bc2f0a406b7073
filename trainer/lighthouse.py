"""`python -m trainer.lighthouse --min_replicas N --bind HOST:PORT --join_timeout_ms MS`.

torchft's Lighthouse, started by module so the control plane can call it through the node's
interpreter by absolute path (a console script may not be on a remote PATH).
"""

import sys

from torchft._torchft import lighthouse_main

if __name__ == "__main__":
    sys.argv[0] = "torchft_lighthouse"
    sys.exit(lighthouse_main())
