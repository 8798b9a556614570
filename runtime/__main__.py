"""`python -m runtime`: the process entry, so it sets the thread settings (runtime/threads.py) before torch loads."""
import sys

from .threads import prepare_threads

prepare_threads()

from .cli import main  # noqa: E402  after prepare_threads: libgomp reads GOMP_SPINCOUNT once, when torch loads it

sys.exit(main())
