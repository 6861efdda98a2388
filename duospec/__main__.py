import sys

from duospec.cli import main

sys.exit(main())
