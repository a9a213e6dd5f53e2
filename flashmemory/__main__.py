import sys

from flashmemory.cli import main

sys.exit(main())
