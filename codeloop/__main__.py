import sys

from codeloop.cli import main

sys.exit(main())
