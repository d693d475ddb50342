import sys

from cua_rl.testing.models import main

sys.exit(main())
