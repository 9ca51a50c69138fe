import sys

from mars_core.tools.cli import main

sys.exit(main())
