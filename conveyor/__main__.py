import sys

from conveyor.cli import main

sys.exit(main())
