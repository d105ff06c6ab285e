import sys

from miles_engine.serve import main

sys.exit(main())
