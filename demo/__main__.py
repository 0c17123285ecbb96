"""`python -m demo`: run the demo (see demo.run)."""

from demo.run import main

raise SystemExit(main())
