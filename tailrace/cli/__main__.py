import sys

from tailrace.cli import main

sys.exit(main())
