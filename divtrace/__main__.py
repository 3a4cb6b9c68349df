import sys

from divtrace.cli import main

sys.exit(main())
