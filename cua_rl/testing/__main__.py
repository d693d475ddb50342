import sys

from cua_rl.testing.cache import main

sys.exit(main())
