import sys

from divtrace.cli.app import main

sys.exit(main())
