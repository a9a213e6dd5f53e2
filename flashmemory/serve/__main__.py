"""`python -m flashmemory.serve`: the OpenAI-compatible server."""

import sys

from flashmemory.serve.launcher import main

sys.exit(main())
