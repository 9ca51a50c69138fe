import sys

from mars_core.cli import main

sys.exit(main())
