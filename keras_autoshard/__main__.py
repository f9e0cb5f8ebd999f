"""`python -m keras_autoshard ...` runs the command line."""

import sys

from keras_autoshard.cli.main import main

sys.exit(main())
